"""The nightly generate worker: claim requests, run the model, store theses as they finish.

:func:`run_queue` works the queue (:mod:`robot_llm.night.queue`) batch by batch: it
claims up to ``model.max_batch_size`` requests, runs them through the configured model
(:mod:`robot_llm.night.model`) as one batch, scores the stance of every thesis
(:mod:`robot_llm.night.stance`) and stores the batch's theses in one transaction, so a crash
loses at most the batch in flight. A watchdog thread (:mod:`robot_llm.night.watchdog`)
heartbeats the run, renews the leases of the batch in flight and ends a process whose
batch made no progress for ``batch.stall_timeout``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from robot_llm.clock import aware_utc
from robot_llm.errors import EXIT_BLOCKED, EXIT_REQUESTS_FAILED, ModelFault, RobotLLMError
from robot_llm.night.model import night_facts, open_configured_model
from robot_llm.night.queue import ClaimedRequest, RequestQueue, Tally, heartbeat_interval
from robot_llm.night.stance import (
    Calibration,
    StanceResult,
    StanceSpec,
    close_thesis,
    label_pieces,
    parse_stance_spec,
)
from robot_llm.night.stance_head import StanceHead, TemplateHead, find_head
from robot_llm.night.watchdog import Watchdog
from robot_llm.store.db import error_line
from robot_llm.thesis.rows import abstains, abstention_row, annotate_rows
from robot_llm.thesis.validity import thesis_problem

if TYPE_CHECKING:
    from robot_llm.config import AppConfig
    from robot_llm.llm.generate import SamplingParams
    from robot_llm.llm.model import Model

__all__ = [
    "BatchError",
    "RunSummary",
    "run_queue",
    "sampling_params",
    "summary_line",
]

log = logging.getLogger(__name__)


class BatchError(RobotLLMError):
    """The run cannot go on (database down, disk full, model cannot load); already stored theses are intact."""


def sampling_params(params: dict[str, Any]) -> tuple[SamplingParams, StanceSpec | None]:
    """Parse a request's ``params`` JSON (the batch contract's shape); ValueError names the bad field."""
    from robot_llm.llm.generate import SamplingParams

    try:
        stop = params.get("stop") or []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"params.stop: expected a list of strings, got {stop!r}")
        sampling = SamplingParams(
            max_new_tokens=int(params["max_new_tokens"]),
            greedy=bool(params["greedy"]),
            temperature=float(params["temperature"]),
            top_k=int(params["top_k"]),
            top_p=float(params["top_p"]),
            seed=int(params["seed"]),
            stop=tuple(stop),
        )
    except KeyError as exc:
        raise ValueError(f"params: missing {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"params: {exc}") from None
    return sampling, parse_stance_spec(params.get("stance"))


@dataclass(frozen=True)
class RunSummary:
    """What one ``run_queue`` call did."""

    run_id: int | None
    worker_id: str
    status: str  # ok | failed | aborted
    done: int = 0
    failed: int = 0
    retried: int = 0
    duplicates: int = 0
    batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False
    blocked_by: str | None = None
    failures: tuple[tuple[int, str], ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of batch time."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def exit_code(self) -> int:
        """The process exit status of ``batch run`` for this run (README: "Exit codes")."""
        if self.failed:
            return EXIT_REQUESTS_FAILED
        if self.blocked_by is not None:
            return EXIT_BLOCKED
        return 0


class _Progress:
    """A tqdm bar with ETA on a terminal, log lines with counts and tokens/s otherwise."""

    def __init__(self, enabled: bool | None, total: int) -> None:
        self.bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="thesis", desc="generate", file=sys.stderr, dynamic_ncols=True)

    def update(self, tally: Tally, total: int, step: int) -> None:
        tps = tally.tokens_per_s or 0.0
        if self.bar is not None:
            self.bar.total = total
            self.bar.set_postfix(failed=tally.failed, tok_s=f"{tps:.1f}", refresh=False)
            self.bar.update(step)
        else:
            log.info(
                "generate: %d/%d done, %d failed, %d retried, %d tokens, %.1f tokens/s",
                tally.handled,
                total,
                tally.failed,
                tally.retried,
                tally.new_tokens,
                tps,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_batch(
    model: Model,
    batch: list[ClaimedRequest],
    on_progress: Callable[[], None],
    calibration: Calibration,
    head: StanceHead | None = None,
) -> tuple[list[dict[str, Any]], dict[int, str], int]:
    """Generate and score ``batch``; returns (thesis rows, errors by request id, new tokens).

    ``head``: a stance head for these weights; a template it covers stores the head's stance,
    read from the hidden state of the pass that scores its news stance (no pass of its own).

    A request that cannot run (bad params, a prompt longer than the window) gets an error
    of its own; a batch the model fails on is re-run one request at a time, so one bad
    request does not spend its batch-mates' attempts.
    """
    errors: dict[int, str] = {}
    ready: list[tuple[ClaimedRequest, SamplingParams, StanceSpec | None]] = []
    rows: list[dict[str, Any]] = []
    for req in batch:
        reason = abstains(req)
        if reason is not None:  # planned without news and signals: an explicit abstention, no generation
            rows.append(abstention_row(req, model.model_id, reason))
            continue
        try:
            params, spec = sampling_params(req.params)
            tokens = len(model.tokenizer.encode(req.prompt))
            if tokens > model.max_positions:
                raise ValueError(f"the prompt has {tokens} tokens, the model's window is {model.max_positions}")
            ready.append((req, params, spec))
        except ValueError as exc:
            errors[req.id] = str(exc)
    groups = [ready] if ready else []
    new_tokens = 0
    while groups:
        group = groups.pop(0)
        started = time.monotonic()
        try:
            # The labels are scored from each row's KV cache as it finishes: no pass of their own.
            completions = model.generate(
                [req.prompt for req, _, _ in group],
                [params for _, params, _ in group],
                on_progress=lambda _done, _total: on_progress(),
                followups=[
                    spec.followup(hidden=_head_for(head, req) is not None) if spec is not None else None
                    for req, _, spec in group
                ],
            )
            on_progress()
            scored, news_scored = [], []
            for (req, _, spec), c in zip(group, completions, strict=True):
                scored.append((spec, label_pieces(model, req.prompt, c, spec)) if spec is not None else None)
                news = spec.news if spec is not None else None
                news_scored.append((news, label_pieces(model, req.prompt, c, spec, news=True)) if news else None)
                on_progress()
            names = [req.template_name for req, _, _ in group]
            stances: list[StanceResult | None] = calibration.stances(model, scored, names)
            news_stances = calibration.stances(model, news_scored, [f"{n}:news" for n in names])
        except ModelFault:  # damaged weights or NaN: every batch would fail the same way
            raise
        except Exception as exc:  # the model's failure is this batch's, not the run's
            if len(group) > 1:
                log.warning("batch of %d failed (%s); running its requests one by one", len(group), error_line(exc))
                groups.extend([item] for item in group)
            else:
                errors[group[0][0].id] = f"{type(exc).__name__}: {exc}"
            continue
        seconds = time.monotonic() - started
        for (req, params, spec), c, thesis_st, news_st in zip(group, completions, stances, news_stances, strict=True):
            # The thesis's stance and the news stance (after the prompt, or asked beside it); the template stores one.
            if spec is not None and spec.after == "prompt":
                thesis_st, news_st = None, thesis_st
            st = news_st if spec is not None and spec.store == "news" else (thesis_st or news_st)
            source = None if st is None else "news" if st is news_st else "thesis"
            template_head = _head_for(head, req)
            if template_head is not None and c.hidden is not None:
                st, source = template_head.stance(c.hidden), "head"
            new_tokens += c.new_token_count
            row = {
                "request_id": req.id,
                "ticker": req.ticker,
                "template_name": req.template_name,
                "template_version": req.template_version,
                "text": close_thesis(c.text, spec, st.label) if spec is not None and st is not None else c.text,
                "stance": st.stance if st else None,
                "stance_label": st.label if st else None,
                "score": st.score if st else None,
                "label_logprobs": st.label_logprobs if st else {},
                "stance_probs": st.probs if st else {},
                "text_stance": thesis_st.stance if thesis_st else None,
                "news_stance": news_st.stance if news_st else None,
                "stance_source": source,
                "model_id": model.model_id,
                "params": req.params,
                "seed": params.seed,
                "prompt_sha256": req.prompt_sha256,
                "prompt_tokens": c.prompt_token_count,
                "completion_tokens": c.new_token_count,
                "finish_reason": c.finish_reason,
                # Rows of a batch are computed together: each carries its batch's time.
                "generation_seconds": seconds,
                "news_ids": req.news_ids,
                "signal_ids": req.signal_ids,
                "as_of": req.as_of,
                "valid_until": req.valid_until,
            }
            problem = thesis_problem(row)
            if problem is None:
                rows.append(row)
            else:
                errors[req.id] = problem
    return rows, errors, new_tokens


def _head_for(head: StanceHead | None, req: ClaimedRequest) -> TemplateHead | None:
    """The stance head of ``req``'s template and version, if the night has one."""
    return head.for_template(req.template_name, req.template_version) if head is not None else None


def run_queue(
    config: AppConfig,
    engine: Engine,
    *,
    worker_id: str | None = None,
    as_of: datetime | None = None,
    stop: threading.Event | None = None,
    progress: bool | None = None,
    preflight: bool = True,
) -> RunSummary:
    """Work the queue until nothing claimable is left (or ``stop`` is set); returns what was done.

    ``as_of`` limits the worker to one night's requests; ``stop`` ends the run after the
    batch in flight is stored; ``progress`` forces the terminal bar on or off (default:
    on when stderr is a terminal). ``preflight`` runs :func:`robot_llm.night.preflight.preflight`
    first and refuses to start when a check fails. The configured model is opened here and
    closed when the run ends. Raises :class:`BatchError` when the database fails mid-run; every thesis
    stored before that stays stored.
    """
    if as_of is not None:
        as_of = aware_utc(as_of, "as_of")
    # Derived once for the night (manifest, tokenizer, templates): preflight and the model's door take them.
    facts = night_facts(config)
    if preflight:
        from robot_llm.night.preflight import require_preflight

        require_preflight(config, facts=facts)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    stop = stop or threading.Event()
    queue = RequestQueue(config, engine, worker_id, as_of)
    tally = Tally()
    try:
        queue.take_over()
        total = queue.remaining()
    except SQLAlchemyError as exc:
        raise BatchError(f"database error before the run started: {error_line(exc)}") from None
    if total == 0:
        log.info("generate: nothing to do")
        return RunSummary(run_id=None, worker_id=worker_id, status="ok")
    model = open_configured_model(config, facts)
    try:
        return _work(config, engine, queue, model, tally, total, stop, progress)
    finally:
        model.close()


def _work(
    config: AppConfig,
    engine: Engine,
    queue: RequestQueue,
    model: Model,
    tally: Tally,
    total: int,
    stop: threading.Event,
    progress: bool | None,
) -> RunSummary:
    try:
        run_id = queue.start_run(total)
    except SQLAlchemyError as exc:
        raise BatchError(f"cannot record the run: {error_line(exc)}") from None
    tick = heartbeat_interval(config)
    watchdog = Watchdog(config, engine.url.render_as_string(hide_password=False), queue, tick)
    watchdog.start()
    bar = _Progress(progress, total)
    calibration = Calibration()  # label priors: scored contexts once per template per night, the batch's mean
    try:
        head = find_head(config.model.store or config.model.checkpoint, model.model_id)  # beside these weights
    except ValueError as exc:  # a damaged head file: the night keeps the label-word stance, and says why
        log.error("stance head not used: %s", exc)
        head = None
    if head is not None:
        log.info("stance head for %s: %s", ", ".join(sorted(head.templates)), head.source or "no source recorded")
    blocked_by: str | None = None
    status, error = "ok", None
    drained = crashed = False
    fault: ModelFault | None = None
    in_flight: list[int] = []
    try:
        while not stop.is_set():
            watchdog.progress()
            claimed, blocked_by = queue.claim(config.model.max_batch_size)
            if not claimed:
                drained = True
                break
            in_flight = [r.id for r in claimed]
            watchdog.progress(in_flight)
            started = time.monotonic()
            rows, errors, new_tokens = _run_batch(model, claimed, watchdog.progress, calibration, head)
            tally.flags.update(annotate_rows(engine, rows, {r.id: r.prompt for r in claimed}))
            tally.label_priors = calibration.measured()
            tally.seconds += time.monotonic() - started
            tally.new_tokens += new_tokens
            tally.batches += 1
            before = tally.handled
            total = max(total, tally.handled + queue.remaining() + len(claimed))
            if rows:
                queue.store(rows, tally, total)
            if errors:
                queue.fail(errors, {r.id: r.attempts for r in claimed}, tally, total)
            in_flight = []
            watchdog.progress([])
            bar.update(tally, total, tally.handled - before)
        if not drained and not in_flight and queue.remaining() == 0:
            drained = True  # the stop came with the last batch: the night is complete, not aborted
        if not drained:
            status, error = "aborted", "stopped on request (signal); the rest of the queue waits for the next run"
        elif tally.failed:
            # Not a crash: the run went through the queue, but the night lacks these theses.
            status = "failed"
            error = (
                f"{tally.failed} request(s) failed for good after {config.batch.max_attempts} attempts "
                "(see `robot-llm batch status`)"
            )
    except SQLAlchemyError as exc:
        status, error, crashed = "failed", f"database error: {error_line(exc)}", True
    except ModelFault as exc:
        status, error, crashed = "failed", str(exc), True
        fault = exc
        _release(queue, in_flight)
    except BaseException as exc:
        status, error, crashed = "failed", f"{type(exc).__name__}: {exc}", True
        _release(queue, in_flight)
        raise
    finally:
        bar.close()
        watchdog.halt()
        if crashed:
            _record_failure(queue, tally, total, error or "")
        else:
            try:
                queue.finish(status, tally, total, error)
            except SQLAlchemyError as exc:
                raise BatchError(
                    f"{tally.done} thesis(es) are stored, but the end of run #{run_id} could not be recorded: "
                    f"{error_line(exc)}"
                ) from None
    if fault is not None:
        raise BatchError(
            f"{error}; nothing of the batch in flight was stored and its requests wait for a rerun "
            f"({tally.done} thesis(es) stored earlier by this run are intact)"
        ) from fault
    if crashed:
        raise BatchError(
            f"{error}; {tally.done} thesis(es) stored by this run are intact; "
            f"run `robot-llm batch run -c {config.source or 'FILE'}` again to resume"
        )
    if blocked_by is not None:
        log.warning("generate: another worker is active on this SQLite database: %s", blocked_by)
    return RunSummary(
        run_id=run_id,
        worker_id=queue.worker_id,
        status=status,
        done=tally.done,
        failed=tally.failed,
        retried=tally.retried,
        duplicates=tally.duplicates,
        batches=tally.batches,
        new_tokens=tally.new_tokens,
        seconds=tally.seconds,
        stopped=not drained,
        blocked_by=blocked_by,
        failures=tuple(tally.failures),
    )


def _release(queue: RequestQueue, request_ids: list[int]) -> None:
    try:
        queue.release(request_ids)
    except SQLAlchemyError as exc:
        log.error("the requests in flight could not be released (their leases expire): %s", error_line(exc))


def _record_failure(queue: RequestQueue, tally: Tally, total: int, error: str) -> None:
    try:
        queue.finish("failed", tally, total, error)
    except SQLAlchemyError as exc:
        log.error("the failure could not be recorded in the runs table either: %s", error_line(exc))


def summary_line(summary: RunSummary) -> str:
    """One human line about a run."""
    if summary.run_id is None:
        return "generate: nothing to do (no pending requests)"
    parts = [
        f"generate run #{summary.run_id} {summary.status}: {summary.done} thesis(es) stored",
        f"{summary.failed} failed",
        f"{summary.retried} retried",
        f"{summary.new_tokens} tokens in {summary.seconds:.1f}s ({summary.tokens_per_s:.1f} tokens/s)",
    ]
    if summary.duplicates:
        parts.append(f"{summary.duplicates} already stored by another worker")
    if summary.stopped:
        parts.append("stopped on request")
    if summary.blocked_by:
        parts.append(f"nothing more could be claimed: another worker holds the SQLite queue: {summary.blocked_by}")
    return ", ".join(parts)
