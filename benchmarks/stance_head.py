"""Train a stance head (:mod:`robot_llm.night.stance_head`) on the model's own hidden states.

    python benchmarks/stance_head.py --tfns-train sent_train.csv --rusentne-train train_data.csv \
        [--store DIR] [--templates brief_en,brief_ru] [--per-class 300] [--out FILE] [--threads 2] [--work DIR]

Data: the *train* splits of the two public MIT sets ``benchmarks/stance.py`` scores (see
``benchmarks/data/stance/SOURCE.md`` for where to get them): Twitter Financial News Sentiment's
``sent_train.csv`` for English templates (read by ``benchmarks/stance_data.py``'s rule),
RuSentNE-2023's ``train_data.csv`` for Russian ones (every sentence whose entity labels all
agree, :func:`rusentne_sentences`). Every sentence that is also one of the bundled
``dev`` or ``eval`` rows is dropped, so the benchmark's rows stay disjoint from training. A
class-balanced sample (``--per-class`` rows per label, fixed seed) is used. Financial
PhraseBank is not used for anything.

Features: each sentence becomes one instrument with that sentence as its only news item, planned
by the product's own ``plan_night`` (the same prompts, example rotation included, as
``benchmarks/stance.py``); the hidden state at the last token of the news stance's context (the
prompt cut before the forecast line, then the cue) is read with the template's head computed
once per chunk of rows, and checked on two rows against the state ``generate``'s followup
scoring keeps (what a night's head reads). The head is a multinomial logistic
regression on the RMS-normalised state, standardised, its L2 penalty chosen by 5-fold
cross-validated log-loss on the training rows; the standardisation is folded into the stored weights.

Writes ``--out`` (default: ``stance_head.json`` beside the store; ``--out
robot_llm/demo_data/stance_head.json`` for the demo's packaged head), which names the weights'
id the night matches it against; heads already in that file for the same weights and other
templates are kept (one run per language can fill one file).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import stance  # noqa: E402  (benchmarks/stance.py: the benchmark's night, rows and store)
import stance_data  # noqa: E402

DATA_NAMES = {
    "en": "Twitter Financial News Sentiment (MIT), sent_train.csv",
    "ru": "RuSentNE-2023 (MIT), train_data.csv, sentences whose entity labels agree",
}
L2_GRID = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
FOLDS = 5


def rusentne_sentences(path: Path) -> list[tuple[int, str]]:
    """RuSentNE-2023 sentences whose entity labels all agree (any entity, not only organisations), with that label.

    Broader than the benchmark's rule (an organisation's sentiment): the train split has only
    ~130 positive sentences by that rule, ~320 by this one; the head learns the news's tone.
    """
    labels: dict[str, set[int]] = {}
    with path.open(encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh, delimiter="\t"):
            labels.setdefault(row["sentence"], set()).add(int(row["label"]))
    return [(next(iter(found)), " ".join(s.split())) for s, found in labels.items() if len(found) == 1]


def training_rows(args: argparse.Namespace) -> dict[str, list[stance.Row]]:
    """Balanced train-split rows per language, none of them a bundled dev or eval sentence."""
    bundled = {r.text for r in stance.read_rows(sorted(stance.DATA.glob("*.tsv")))}
    sources = {"en": (args.tfns_train, stance_data.tfns), "ru": (args.rusentne_train, rusentne_sentences)}
    out = {}
    for lang, (path, read) in sources.items():
        if path is None:
            continue
        rows = [(label, text) for label, text in read(path) if text not in bundled]
        picked = stance_data.balanced(rows, args.per_class, args.seed)
        out[lang] = [stance.Row(lang, "train", label, text) for label, text in picked]
    return out


def hidden_states(config_path: Path, rows: list[stance.Row], model: object) -> tuple[list[list[float]], object]:
    """Each row's hidden state where its template's news stance is read, and the template's stance spec."""
    from sqlalchemy import select

    from robot_llm.llm.generate import SamplingParams
    from robot_llm.night.stance import parse_stance_spec
    from robot_llm.store.db import GenerationRequest, session_scope

    _, engine = stance.plan_rows(config_path, rows)
    with session_scope(engine) as session:
        requests = {r.ticker: (r.prompt, r.params) for r in session.scalars(select(GenerationRequest))}
    engine.dispose()
    prompts = [requests[f"N{i:04d}"][0] for i in range(len(rows))]
    spec = parse_stance_spec(requests["N0000"][1]["stance"])
    assert spec is not None, "the template asks no stance"
    news = spec.news if spec.news is not None else spec
    if news.after != "prompt":
        raise SystemExit("the template reads no stance after the prompt (no news stance): a head has nothing to read")
    contexts = [news.followup().context(p, "") for p in prompts]
    started = time.perf_counter()
    states = prefix_shared_states(model, contexts)
    print(f"  {len(states)} hidden states in {time.perf_counter() - started:.0f} s", flush=True)
    # The night reads the state through generate's followup scoring: check that it is the same state.
    followups = [news.followup(hidden=True)] * 2
    probe = model.generate(prompts[:2], [SamplingParams(max_new_tokens=0)] * 2, followups=followups)
    for c, state in zip(probe, states, strict=False):
        if c.hidden is None:
            raise SystemExit("the engine kept no hidden state (the stream and memory engines do)")
        off = max(abs(a - b) for a, b in zip(c.hidden, state, strict=True)) / max(abs(v) for v in state)
        print(f"  the night's followup path reads the same state (max difference {off:.1e} of the largest value)")
        if off > 1e-3:
            raise SystemExit("the hidden state read here differs from the night's: the head would not fit it")
    return states, spec


def spec_params(config_path: Path) -> dict[str, object]:
    """The planned stance params of the night in ``config_path``'s database (what the head's labels follow)."""
    from sqlalchemy import select

    from robot_llm.config import load_config
    from robot_llm.store.db import GenerationRequest, make_engine, session_scope

    engine = make_engine(load_config(config_path).database.url)
    with session_scope(engine) as session:
        params = session.scalars(select(GenerationRequest.params).limit(1)).one()
    engine.dispose()
    return params["stance"]


def prefix_shared_states(model: object, contexts: list[str], chunk: int = 32) -> list[list[float]]:
    """The hidden state at each context's last token: rows sorted so that a chunk shares its template head.

    The head (worked examples) is computed once per chunk and attended by every row, as
    ``generate``'s ``share_prefix`` does; only the last position reaches the output head.
    """
    import torch

    from robot_llm.llm.generate import shared_prefix_length

    engine, tokenizer = model.engine, model.tokenizer
    ids = [tokenizer.encode(c) for c in contexts]
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    states: list[list[float]] = [[] for _ in ids]
    for start in range(0, len(order), chunk):
        rows = order[start : start + chunk]
        shared = shared_prefix_length([ids[i] for i in rows]) if len(rows) > 1 else 0
        width = max(len(ids[i]) for i in rows) - shared
        pad = torch.tensor([width + shared - len(ids[i]) for i in rows])
        batch = torch.full((len(rows), width), tokenizer.eos_id, dtype=torch.long)
        for b, i in enumerate(rows):
            batch[b, int(pad[b]) :] = torch.tensor(ids[i][shared:])
        cache = engine.new_cache(len(rows), width, pad)
        if shared:
            prefix = engine.new_cache(1, shared)
            engine.forward(torch.tensor([ids[rows[0]][:shared]]), prefix, last_only=True)
            cache.share_prefix(prefix)
        engine.forward(batch, cache, last_only=True)
        for b, i in enumerate(rows):
            states[i] = engine.last_hidden[b, -1].float().cpu().tolist()
        print(f"  {min(start + chunk, len(order))}/{len(order)} rows", flush=True)
    return states


def fit(x: object, y: object, l2: float, steps: int = 200) -> tuple[object, object]:
    """Multinomial logistic regression (L-BFGS, L2 on the weights) on standardised ``x [N, H]``, ``y [N]``.

    Classes weigh inversely to their counts: a set short of one class (RuSentNE's positives)
    does not teach the head a prior the balanced evaluation does not have.
    """
    import torch

    h = x.shape[1]
    k = int(y.max()) + 1
    weight = len(y) / (k * torch.bincount(y, minlength=k).clamp_min(1).double())
    w = torch.zeros(k, h, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(k, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> object:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y, weight=weight) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def train(states: list[list[float]], labels: list[int], seed: int) -> tuple[object, object, dict[str, float]]:
    """Weights and bias on RMS-normalised states (standardisation folded in), and the cross-validation figures."""
    import torch

    x = torch.tensor(states, dtype=torch.float64)
    x = x / x.pow(2).mean(dim=1, keepdim=True).sqrt()
    y = torch.tensor(labels)
    order = list(range(len(labels)))
    random.Random(seed).shuffle(order)
    folds = [order[i::FOLDS] for i in range(FOLDS)]

    def standardise(rows: object) -> tuple[object, object]:
        return x[rows].mean(dim=0), x[rows].std(dim=0).clamp_min(1e-6)

    scores = {}
    for l2 in L2_GRID:
        loss = right = 0.0
        for held in folds:
            keep = torch.tensor([i for i in order if i not in set(held)])
            test = torch.tensor(held)
            mean, std = standardise(keep)
            w, b = fit((x[keep] - mean) / std, y[keep], l2)
            logits = ((x[test] - mean) / std) @ w.T + b
            loss += float(torch.nn.functional.cross_entropy(logits, y[test], reduction="sum"))
            right += float((logits.argmax(dim=1) == y[test]).sum())
        scores[l2] = (loss / len(labels), right / len(labels))
        print(f"  l2 {l2:g}: cross-validated log-loss {scores[l2][0]:.3f}, accuracy {scores[l2][1]:.3f}")
    best = min(L2_GRID, key=lambda l2: scores[l2][0])
    mean, std = standardise(torch.arange(len(labels)))
    w, b = fit((x - mean) / std, y, best)
    w_folded = w / std
    b_folded = b - w_folded @ mean
    return w_folded, b_folded, {"l2": best, "cv_log_loss": scores[best][0], "cv_accuracy": scores[best][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tfns-train", type=Path, help="Twitter Financial News Sentiment's sent_train.csv")
    parser.add_argument("--rusentne-train", type=Path, help="RuSentNE-2023's train_data.csv")
    parser.add_argument("--store", type=Path, help="a converted weight store (default: the demo's Gemma 3 270M)")
    parser.add_argument("--templates", default="brief_en,brief_ru", help="templates to train a head for")
    parser.add_argument("--prompts-dir", help="a prompts.dir with your own templates (looked up first)")
    parser.add_argument("--per-class", type=int, default=300, help="training rows per label and language")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--out", type=Path, help="the head file (default: stance_head.json beside the store)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--work", type=Path, help="folder kept between runs (the default store is converted there)")
    args = parser.parse_args()

    import torch

    from robot_llm.config import load_config
    from robot_llm.night.stance import parse_stance_spec
    from robot_llm.night.stance_head import FORMAT, HEAD_FILE, weights_id
    from robot_llm.prompting.loading import find_template, load_template

    torch.set_num_threads(args.threads)
    print(stance.machine_line(args.threads))
    by_lang = training_rows(args)
    with tempfile.TemporaryDirectory(prefix="robot-llm-head-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        store = args.store.resolve() if args.store else stance.default_store(work)
        heads, model = {}, None
        try:
            for name in args.templates.split(","):
                folder = Path(tempfile.mkdtemp(prefix=f"head-{name}-", dir=work))
                probe = stance.night_config(folder, store, name, [stance.Row("", "", 0, "")], args)
                template = load_template(find_template(load_config(probe), name))
                rows = by_lang.get(template.language)
                if not rows:
                    print(f"{name}: no {template.language} training file given; skipped")
                    continue
                config_path = stance.night_config(folder, store, name, rows, args)
                model = model or stance.open_model(config_path)
                print(f"{name}: {len(rows)} rows {dict(Counter(r.label for r in rows))}")
                kept = work / f"states-{name}-{args.per_class}-{args.seed}.json"  # reused by a rerun with --work
                if kept.is_file():
                    states = json.loads(kept.read_text())
                    spec = parse_stance_spec(json.loads((work / f"spec-{name}.json").read_text()))
                else:
                    states, spec = hidden_states(config_path, rows, model)
                    kept.write_text(json.dumps(states))
                    (work / f"spec-{name}.json").write_text(json.dumps(spec_params(config_path)))
                values = [value for _, value in spec.labels]
                w, b, figures = train(states, [values.index(float(r.label)) for r in rows], args.seed)
                heads[name] = {
                    "version": template.version,
                    "labels": dict(spec.labels),
                    "weights": [[round(float(v), 7) for v in row] for row in w],
                    "bias": [round(float(v), 7) for v in b],
                    "trained": {
                        "data": DATA_NAMES[template.language],
                        "rows": len(rows),
                        "per_class": args.per_class,
                        "seed": args.seed,
                        **{k: round(v, 4) for k, v in figures.items()},
                    },
                }
            assert model is not None, "no template was trained"
            model_id = weights_id(model.model_id)
        finally:
            if model is not None:
                model.close()
    out = args.out or store / HEAD_FILE
    if out.is_file():  # another run's heads for the same weights (another language) are kept
        kept = json.loads(out.read_text(encoding="utf-8"))
        if kept.get("model") == model_id:
            heads = {**kept.get("templates", {}), **heads}
    source = (
        "benchmarks/stance_head.py on public train splits (each template's 'trained'), "
        "the bundled dev/eval sentences of benchmarks/stance.py excluded"
    )
    out.write_text(
        json.dumps({"format": FORMAT, "model": model_id, "source": source, "templates": heads}, ensure_ascii=False)
        + "\n",
        encoding="utf-8",
    )
    rows = ", ".join(f"{n} ({h['trained']['rows']} rows)" for n, h in heads.items())
    print(f"{out}: heads for {rows}; weights {model_id}")


if __name__ == "__main__":
    main()
