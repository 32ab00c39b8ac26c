"""The generate worker in process, on SQLite and PostgreSQL, with the tiny fixture model."""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import pytest
from batch_helpers import TINY
from sqlalchemy import update

from robot_llm.night.plan import plan_night
from robot_llm.night.worker import run_queue
from robot_llm.store.db import GenerationRequest, NewsItem, NewsTicker, Run, Thesis, session_scope, utcnow


def _expected_stance(logprobs: dict[str, float], labels: dict[str, float]) -> tuple[float, str, float]:
    top = max(logprobs.values())
    weights = {k: math.exp(v - top) for k, v in logprobs.items()}
    total = sum(weights.values())
    probs = {k: w / total for k, w in weights.items()}
    best = max(probs, key=lambda k: probs[k])
    return sum(probs[k] * labels[k] for k in labels), best.strip(), probs[best]


def test_plan_then_run_stores_theses_with_stance_and_rerun_adds_nothing(benv, night):
    config = benv.config()
    with session_scope(benv.engine) as s:
        item = NewsItem(
            feed="wire",
            item_key="k1",
            title="Company 0 raises its dividend",
            summary="",
            fetched_at=night - timedelta(hours=2),
            content_hash="h1",
        )
        item.tickers.append(NewsTicker(ticker="T000"))
        s.add(item)
        s.flush()
        news_id = item.id

    plan = plan_night(config, benv.engine, night)
    assert (plan.created, plan.existing, plan.skipped) == (3, 0, ())

    summary = run_queue(config, benv.engine, as_of=night, progress=False)  # preflight included
    assert (summary.status, summary.done, summary.failed) == ("ok", 3, 0)
    assert summary.new_tokens > 0

    requests = {r.id: r for r in benv.requests()}
    theses = benv.theses()
    assert len(theses) == 3 and {t.request_id for t in theses} == set(requests)
    for t in theses:
        req = requests[t.request_id]
        assert req.status == "done" and req.attempts == 1 and req.lease_owner is None
        labels = req.params["stance"]["labels"]
        assert set(t.label_logprobs) == set(labels)
        assert -1.0 <= t.stance <= 1.0 and 0.0 < t.score <= 1.0
        stance, label, score = _expected_stance(t.label_logprobs, labels)
        assert math.isclose(t.stance, stance, rel_tol=1e-9, abs_tol=1e-12)
        assert (t.stance_label, round(t.score, 9)) == (label, round(score, 9))
        assert t.model_id.startswith("yalm-tiny:yalm-tiny/fp32@")
        assert t.seed == req.params["seed"] and t.params == req.params
        assert t.prompt_sha256 == req.prompt_sha256 and t.prompt_tokens == req.prompt_tokens
        assert 1 <= t.completion_tokens <= req.params["max_new_tokens"]
        assert t.as_of == night and t.valid_until == req.valid_until
        assert night < t.available_at <= utcnow()
        assert t.generation_seconds > 0
    by_ticker = {t.ticker: t for t in theses}
    assert by_ticker["T000"].news_ids == [news_id] and by_ticker["T001"].news_ids == []

    run = benv.runs()[-1]
    assert (run.status, run.done, run.total) == ("ok", 3, 3)
    assert run.tokens_per_s and run.tokens_per_s > 0 and run.heartbeat_at is not None
    assert run.counts["theses"] == 3 and run.counts["new_tokens"] == summary.new_tokens

    # Re-planning and re-running the same night neither plans nor generates anything twice.
    again = plan_night(config, benv.engine, night)
    assert (again.created, again.existing) == (0, 3)
    rerun = run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    assert rerun.run_id is None and rerun.done == 0
    assert [(t.id, t.text) for t in benv.theses()] == [(t.id, t.text) for t in theses]


def test_a_request_that_keeps_failing_is_failed_and_the_rest_go_on(benv, night, capsys):
    config = benv.config(batch={"max_attempts": 2})
    good = benv.seed(3, night)
    (bad,) = benv.seed(1, night, start=3, prompt=lambda i: "news " * 80 + ":")

    summary = run_queue(config, benv.engine, progress=True, preflight=False)

    assert "4/4" in capsys.readouterr().err  # the terminal bar counted every request
    assert (summary.done, summary.failed, summary.retried) == (3, 1, 1)
    requests = {r.id: r for r in benv.requests()}
    assert requests[bad].status == "failed" and requests[bad].attempts == 2
    assert "window is 64" in requests[bad].last_error
    assert all(requests[i].status == "done" for i in good)
    assert sorted(t.request_id for t in benv.theses()) == good
    run = benv.runs()[-1]
    assert run.status == "failed" and "1 request(s) failed for good" in run.error
    assert run.counts["failed"] == 1 and run.counts["retried"] == 1 and summary.exit_code == 1
    assert summary.failures == ((bad, requests[bad].last_error),)


def test_a_thesis_another_worker_stored_first_is_not_stored_twice(benv, night, caplog):
    config = benv.config()
    (rid,) = benv.seed(1, night)
    req = benv.requests()[0]
    # Another worker (whose lease on it we were handed after expiry) committed it first.
    with session_scope(benv.engine) as s:
        s.add(
            Thesis(
                request_id=rid,
                ticker=req.ticker,
                template_name=req.template_name,
                template_version=req.template_version,
                text="the other worker's thesis",
                model_id="yalm-tiny",
                params=req.params,
                seed=req.params["seed"],
                prompt_sha256=req.prompt_sha256,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=1,
                finish_reason="length",
                generation_seconds=0.1,
                as_of=req.as_of,
                available_at=utcnow(),
                valid_until=req.valid_until,
            )
        )

    with caplog.at_level(logging.INFO, logger="robot_llm.night.worker"):
        summary = run_queue(config, benv.engine, progress=False, preflight=False)

    assert (summary.status, summary.done, summary.duplicates) == ("ok", 0, 1)
    assert "generate: 1/1 done, 0 failed" in caplog.text  # log lines instead of a bar
    (thesis,) = benv.theses()
    assert thesis.text == "the other worker's thesis"
    assert benv.requests()[0].status == "done"


def test_sqlite_worker_claims_nothing_while_another_is_alive(benv, night):
    config = benv.config()
    benv.seed(2, night)
    with session_scope(benv.engine) as s:
        s.add(Run(kind="generate", status="running", started_at=utcnow(), heartbeat_at=utcnow(), host="h", pid=1))

    summary = run_queue(config, benv.engine, progress=False, preflight=False)

    if benv.kind == "sqlite":
        assert summary.done == 0 and summary.blocked_by is not None and "pid 1" in summary.blocked_by
        assert benv.status_counts() == {"pending": 2}
    else:  # PostgreSQL workers share the queue
        assert summary.done == 2 and summary.blocked_by is None


def test_expired_lease_is_claimed_again_and_a_worker_that_died_too_often_fails_it(benv, night):
    config = benv.config(batch={"max_attempts": 2})
    retry, dead = benv.seed(2, night)
    expired = utcnow() - timedelta(seconds=5)
    # Two requests whose worker died holding them: once, and as often as max_attempts allows.
    with benv.engine.begin() as conn:
        for rid, attempts in ((retry, 1), (dead, 2)):
            conn.execute(
                update(GenerationRequest)
                .where(GenerationRequest.id == rid)
                .values(status="running", lease_owner="gone", lease_expires_at=expired, attempts=attempts)
            )

    summary = run_queue(config, benv.engine, progress=False, preflight=False)

    assert summary.done == 1
    requests = {r.id: r for r in benv.requests()}
    assert (requests[retry].status, requests[retry].attempts) == ("done", 2)
    assert requests[dead].status == "failed" and "died 2 times" in requests[dead].last_error


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_stream_backend_from_a_converted_store(benv, night, tmp_path):
    from robot_llm.llm.store.writer import convert

    convert(TINY, tmp_path / "store", dtype="fp32", reserve_bytes=0)
    config = benv.config(model={"backend": "stream", "store": str(tmp_path / "store"), "checkpoint": None})
    benv.seed(3, night)

    summary = run_queue(config, benv.engine, progress=False)  # preflight checks the store

    assert (summary.status, summary.done) == ("ok", 3)
    assert all(t.stance_label in ("up", "down", "flat") for t in benv.theses())


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_naive_as_of_is_refused(benv, night):
    with pytest.raises(ValueError, match="naive"):
        run_queue(benv.config(), benv.engine, as_of=night.replace(tzinfo=None), preflight=False)
