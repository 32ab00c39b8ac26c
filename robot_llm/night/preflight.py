"""Preflight: everything the night needs, checked before anything heavy starts.

A night that cannot finish should fail at 22:00 with one clear line per cause, not at
03:00 halfway through. :func:`preflight` runs every check and returns them all (one
failure does not hide the next); ``robot-llm doctor -c FILE`` prints them, and
:func:`robot_llm.night.worker.run_queue` calls :func:`require_preflight` before it loads the
model. Nothing here writes to the database or loads the model's weights.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig
    from robot_llm.llm.store.reader import Manifest
    from robot_llm.night.model import NightFacts

__all__ = ["Check", "PreflightError", "doctor", "format_checks", "preflight", "require_preflight"]

#: Free space the database's disk must keep beyond the night's theses.
MIN_FREE_BYTES = 256 * 2**20
#: A generous size of one stored thesis with its indexes (text, params, JSON ids).
THESIS_BYTES = 64 * 2**10


@dataclass(frozen=True)
class Check:
    """One preflight check: ``ok`` is True (passed), False (failed) or None (not applicable / skipped).

    ``warning``: passed, but with something the user should fix (the night still runs).
    """

    name: str
    ok: bool | None
    message: str
    warning: bool = False

    def line(self) -> str:
        """``ok   name: message`` / ``warn name: message`` / ``FAIL name: message`` / ``skip name: message``."""
        tag = ("warn" if self.warning else "ok  ") if self.ok else "FAIL" if self.ok is False else "skip"
        return f"{tag} {self.name}: {self.message}"


class PreflightError(RobotLLMError):
    """At least one preflight check failed; the message has one line per failed check."""


def _database(config: AppConfig) -> tuple[list[Check], Engine | None]:
    from robot_llm.store.db import DatabaseError, check_connection, make_engine
    from robot_llm.store.migrate import ensure_current

    where = config.database.url
    try:
        engine = make_engine(config.database.url)
        where = engine.url.render_as_string(hide_password=True)
        check_connection(engine)
    except (DatabaseError, ImportError, ValueError) as exc:
        return [
            Check("database", False, str(exc)),
            Check("schema", None, "not checked: the database is unreachable"),
        ], None
    checks = [Check("database", True, f"reachable at {where}")]
    try:
        ensure_current(engine, str(config.source) if config.source else None)
        checks.append(Check("schema", True, "migrated to the current revision"))
    except DatabaseError as exc:
        checks.append(Check("schema", False, str(exc)))
    return checks, engine


def _queue(engine: Engine) -> Check:
    """The latest night's health (:mod:`robot_llm.report.health`): a warning when it lacks theses."""
    from robot_llm.report.health import latest_nights, night_health

    nights = latest_nights(engine)
    if not nights:
        return Check("queue", None, "no night planned yet")
    health = night_health(engine, nights)
    return Check("queue", True, f"night {nights[0].isoformat()}: {health.line()}", warning=health.troubled)


def _disk(config: AppConfig, engine: Engine | None) -> Check:
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    from robot_llm.store.db import GenerationRequest, error_line

    url = config.database.url
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return Check("disk", None, "the database is a server: its disk is the server's business")
    folder = Path(url[len("sqlite:///") :]).parent
    pending: int | None = 0
    counted = ""
    if engine is not None:
        try:
            with engine.connect() as conn:
                pending = int(
                    conn.execute(
                        select(func.count())
                        .select_from(GenerationRequest)
                        .where(GenerationRequest.status.in_(("pending", "running")))
                    ).scalar_one()
                )
        except SQLAlchemyError as exc:  # an unmigrated database (the schema check says so), or a full disk
            pending, counted = None, error_line(exc)
    need = MIN_FREE_BYTES + (pending or 0) * THESIS_BYTES
    free = shutil.disk_usage(folder).free
    if free < need:
        work = (
            f"{pending} pending or running request(s)"
            if pending is not None
            else f"the pending requests could not be counted: {counted}"
        )
        return Check(
            "disk",
            False,
            f"{folder} has {free / 2**20:.0f} MiB free, the night needs at least {need / 2**20:.0f} MiB "
            f"({work}); free some space",
        )
    return Check("disk", True, f"{free / 2**30:.1f} GiB free in {folder}")


def _store(store: Path, deep: bool, manifest: Manifest | None) -> Check:
    """The store's files: ``deep`` hashes every byte; the default reads headers and sampled blocks.

    The default guarantees every file is present at its manifest size with a header that
    parses, and that the first and last block of every file, and one more per file chosen
    by the date (another each day), match their checksums: a damaged header, a truncated or
    overwritten tail is caught at once; damage elsewhere in a file is caught by the night's
    first pass, which verifies every block before anything is stored.
    """
    from datetime import date

    from robot_llm.llm.store.checksum import BlockMismatch, check_sampled
    from robot_llm.llm.store.layout import FileLayout, StoreError
    from robot_llm.llm.store.reader import read_manifest, verify

    try:
        # Read again only to say why it could not be read.
        manifest = manifest if manifest is not None else read_manifest(store)
    except StoreError as exc:
        return Check("weights", False, f"model.store: {exc} (convert with `robot-llm model convert`)")
    problems: list[str] = []
    read = 0
    if deep:
        problems = verify(store)
    else:
        spec = manifest.checksums
        for entry in manifest.files:
            path = store / entry.name
            if not path.is_file():
                problems.append(f"{entry.name}: missing")
                continue
            if path.stat().st_size != entry.size:
                problems.append(f"{entry.name}: size {path.stat().st_size} != manifest {entry.size}")
                continue
            try:
                FileLayout.read(path)
                if spec is not None and entry.blocks:
                    picks = check_sampled(path, entry.blocks, entry.size, spec.block_bytes, date.today().toordinal())
                    read += sum(min(spec.block_bytes, entry.size - n * spec.block_bytes) for n in picks)
            except (StoreError, BlockMismatch) as exc:
                problems.append(str(exc).replace(f"{path}: ", f"{entry.name}: "))
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        return Check("weights", False, f"model.store {store} is damaged: {shown} (convert again to repair)")
    if deep:
        how = "sha256 verified"
    elif manifest.checksums is None:
        return Check(
            "weights",
            True,
            f"store {store}: {len(manifest.files)} files, sizes and headers match; its manifest has no block "
            f"checksums, so nights do not verify its bytes (`robot-llm model verify --record-checksums {store}`)",
            warning=True,
        )
    else:
        how = (
            f"sizes and headers match, sampled blocks verified ({read / 2**20:.0f} MiB of "
            f"{manifest.total_bytes / 2**20:.0f} MiB read; the night verifies every block; --deep checks sha256)"
        )
    return Check("weights", True, f"store {store}: {len(manifest.files)} files, {how}")


def _checkpoint(config: AppConfig) -> Check:
    from robot_llm.llm.store.checkpoint import CheckpointError, module_plan, resolve_weights_dir
    from robot_llm.night.model import ModelConfigError, model_shape

    assert config.model.checkpoint is not None
    try:
        shape = model_shape(config)
        folder = resolve_weights_dir(config.model.checkpoint)
    except (ModelConfigError, CheckpointError) as exc:
        return Check("weights", False, f"model.checkpoint: {exc}")
    names = [name for _, _, name, _ in module_plan(shape)]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return Check("weights", False, f"model.checkpoint {folder} lacks {shown}")
    return Check("weights", True, f"checkpoint {folder}: all {len(names)} module files present")


def _weights(config: AppConfig, deep: bool, manifest: Manifest | None) -> Check:
    m = config.model
    if m.store is not None:  # the runtime reads the store whenever one is set
        return _store(m.store, deep, manifest)
    return _checkpoint(config)


def _vocab(config: AppConfig, facts: NightFacts) -> Check:
    from robot_llm.llm.tokenizer import load_tokenizer

    assert config.model.vocab is not None
    try:
        # Built again only to say why it does not load.
        tokenizer = facts.tokenizer if facts.tokenizer is not None else load_tokenizer(config.model.vocab)
    except (OSError, ValueError, RuntimeError) as exc:
        return Check("vocab", False, f"model.vocab: {exc}")
    return Check("vocab", True, f"{config.model.vocab}: {tokenizer.vocab_size} pieces")


def _memory(config: AppConfig, facts: NightFacts) -> Check:
    """The plan the night will use (made as the batch worker makes it when it opens the model), or why none fits."""
    from dataclasses import replace

    from robot_llm.llm.engine.runtime import night_machine, night_work, plan_run
    from robot_llm.llm.plan.planner import PlanError
    from robot_llm.llm.plan.rates import describe_rates
    from robot_llm.night.model import model_settings, model_shape

    m = config.model
    manifest = facts.manifest
    shape = model_shape(config, manifest)
    settings = model_settings(config, facts.templates)
    weights: str | Manifest
    if m.store is not None:  # the runtime reads the store whenever one is set (its own bytes per layer)
        from robot_llm.llm.store.reader import read_manifest

        weights = manifest if manifest is not None else read_manifest(m.store)
    else:  # a release is converted to fp16 (stream) or loaded in the compute dtype (memory)
        weights = m.dtype if m.dtype in ("fp32", "bf16", "fp16") else "fp16"
    if m.backend == "memory":  # holds every layer in RAM, like the stream engine homed in RAM
        settings = replace(settings, home="ram")
    # The machine as the night sees it: its rates measured as the night measures them (once per process), except
    # the GPU's: probing them allocates on the GPU, which could push a night running there out of its memory.
    machine, sources = night_machine(settings, probe_gpu=False)
    rates = f"rates: {describe_rates(machine, sources)}"
    try:
        chosen = plan_run(settings, shape, night_work(settings, shape), weights, machine)
    except PlanError as exc:
        return Check("memory", False, f"the model does not fit: {exc}".replace("\n", " "))
    if chosen.batch_size < m.max_batch_size:
        return Check(
            "memory",
            False,
            f"model.max_batch_size {m.max_batch_size} does not fit, at most {chosen.batch_size} does "
            f"(weights in {chosen.weight_home}): lower model.max_batch_size",
        )
    # The watchdog hears from the engine after every layer: one layer of the longest pass
    # (a batch's prefill) must fit in batch.stall_timeout, or every batch is killed midway.
    layer_s = chosen.prefill_seconds / shape.num_layers
    stall_s = config.batch.stall_timeout.total_seconds()
    if layer_s > stall_s:
        return Check(
            "memory",
            False,
            f"one layer of a batch's prefill takes an estimated {layer_s:.0f}s (batch {chosen.batch_size} on "
            f"{chosen.device}), longer than batch.stall_timeout {stall_s:.0f}s: the watchdog would end every "
            "batch; lower model.max_batch_size or raise batch.stall_timeout\n       " + rates,
        )
    summary = (
        f"batch {chosen.batch_size} fits on {chosen.device} (weights in {chosen.weight_home}, "
        f"estimated {chosen.tokens_per_second:.3g} tokens/s); the night's plan:"
    )
    lines = [rates, *chosen.describe().splitlines()]
    if chosen.device == "cpu" and m.backend == "stream":
        from robot_llm.llm.plan.machine import cpu_compute_path, cpu_kernels_path

        weight_dtype = weights if isinstance(weights, str) else weights.dtype
        lines.append(cpu_compute_path(weight_dtype, chosen.compute_dtype))
        if weight_dtype in ("int4", "int8"):
            lines.append(cpu_kernels_path())
    return Check("memory", True, summary + "".join(f"\n       {line}" for line in lines))


def _templates(config: AppConfig, facts: NightFacts) -> Check:
    from datetime import timedelta

    from robot_llm.llm.tokenizer import load_tokenizer
    from robot_llm.prompting.budget import render_within_budget
    from robot_llm.prompting.context import NewsEntry, SignalEntry
    from robot_llm.prompting.loading import load_templates
    from robot_llm.prompting.stance_prompt import stance_label_problems
    from robot_llm.store.db import utcnow
    from robot_llm.thesis.priors import template_warnings

    assert config.model.vocab is not None
    try:
        tokenizer = facts.tokenizer if facts.tokenizer is not None else load_tokenizer(config.model.vocab)
    except (OSError, ValueError, RuntimeError):
        return Check("templates", None, "not checked: the tokenizer does not load (see vocab)")
    templates = facts.templates if facts.templates is not None else load_templates(config)
    now = utcnow()
    problems: list[str] = []
    for template in templates.values():
        for instrument in config.instruments:
            # Representative data so the news and forecast branches render too.
            news = [
                NewsEntry(
                    id=0,
                    title=f"{instrument.name} news headline",
                    summary="A short summary of the news.",
                    feed="preflight",
                    published_at=now - timedelta(hours=1),
                    fetched_at=now,
                    mentions=1,
                    in_title=True,
                )
            ]
            signals = [
                SignalEntry(
                    id=0, horizon="1d", direction=1, target=100.0, confidence=0.6, model="preflight", generated_at=now
                )
            ]
            try:
                render_within_budget(template, config, instrument, now, news, signals, tokenizer)
            except RobotLLMError as exc:
                problems.append(f"{template.name} for {instrument.ticker}: {exc}")
    warnings: list[str] = []
    for template in templates.values():
        errors, uneven = stance_label_problems(template, tokenizer)
        problems.extend(errors)
        warnings.extend(uneven)
        warnings.extend(template_warnings(template))
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        return Check("templates", False, shown)
    n = len(templates) * len(config.instruments)
    message = f"all {n} template x instrument prompts render and fit the window"
    if warnings:
        return Check("templates", True, f"{message}; warning: {'; '.join(warnings)}", warning=True)
    return Check("templates", True, message)


def _stance(config: AppConfig, engine: Engine | None) -> Check:
    """The label priors the last night measured: a label that never wins is a warning."""
    from sqlalchemy.exc import SQLAlchemyError

    from robot_llm.thesis.priors import measured_priors, prior_warnings

    if engine is None:
        return Check("stance", None, "not checked: the database is unreachable")
    try:
        priors = measured_priors(engine)
    except SQLAlchemyError as exc:
        return Check("stance", None, f"not checked: {type(exc).__name__}")
    if not priors:
        return Check("stance", None, "no night has measured the stance labels' priors yet")
    warnings = prior_warnings(priors, set(config.prompts.templates))
    if warnings:
        return Check("stance", True, "; ".join(warnings), warning=True)
    return Check("stance", True, "every stance label of the last night can win (log-probability above -5)")


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except RobotLLMError as exc:
        return Check(name, False, str(exc))


def preflight(config: AppConfig, *, deep: bool = False, facts: NightFacts | None = None) -> list[Check]:
    """Run every check against ``config`` and return them all, in order.

    ``deep`` also hashes every store file against its manifest (minutes for 100B weights).
    ``facts``: the night's manifest, tokenizer and templates when it has derived them already
    (:func:`robot_llm.night.model.night_facts`); otherwise they are derived here, once.
    """
    from robot_llm.night.model import night_facts

    facts = facts or night_facts(config)
    source = str(config.source) if config.source else "(in memory)"
    checks = [Check("config", True, f"{source} is valid")]
    db_checks, engine = _database(config)
    checks.extend(db_checks)
    try:
        if engine is not None and all(c.ok for c in db_checks):
            # First: how the latest night stands (stuck, failed, empty...), before what the next one needs.
            checks.insert(0, _guarded("queue", lambda: _queue(engine)))
        checks.append(_guarded("disk", lambda: _disk(config, engine)))
        stance = _guarded("stance", lambda: _stance(config, engine))  # listed after the templates it is about
    finally:
        if engine is not None:
            engine.dispose()
    checks.append(_guarded("weights", lambda: _weights(config, deep, facts.manifest)))
    checks.append(_guarded("vocab", lambda: _vocab(config, facts)))
    checks.append(_guarded("memory", lambda: _memory(config, facts)))
    checks.append(_guarded("templates", lambda: _templates(config, facts)))
    checks.append(stance)
    return checks


def require_preflight(config: AppConfig, *, deep: bool = False, facts: NightFacts | None = None) -> list[Check]:
    """:func:`preflight`, raising :class:`PreflightError` (one line per failed check) when any failed."""
    checks = preflight(config, deep=deep, facts=facts)
    failed = [c for c in checks if c.ok is False]
    if failed:
        raise PreflightError(
            "preflight failed, the night would not finish:\n"
            + "\n".join(f"  {c.name}: {c.message}" for c in failed)
            + "\n(run `robot-llm doctor` to see every check)"
        )
    return checks


def doctor(config_path: str | os.PathLike[str], *, deep: bool = False) -> list[Check]:
    """Load the config file and run :func:`preflight`; a config that does not load is the one failed check."""
    from robot_llm.config import ConfigError, load_config

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        return [Check("config", False, str(exc))]
    return preflight(config, deep=deep)


def format_checks(checks: list[Check]) -> str:
    """One line per check, then a verdict."""
    failed = sum(1 for c in checks if c.ok is False)
    verdict = f"{failed} check(s) failed" if failed else "all checks passed"
    return "\n".join([*(c.line() for c in checks), verdict])
