"""Honest nights: a damaged model, a dead worker or an empty thesis never pass as success (issue 23).

The fault matrix runs the real tiny YaLM store through the real worker (``robot-llm batch run``
processes, the stream engine) on real SQLite and PostgreSQL. Every case ends the same way:
nothing empty or non-finite stored, a non-zero exit where anything failed, the previous thesis
still the latest strategies read, and an immediate rerun (after the fault is repaired) that
completes the night in one go with nothing lost and nothing stored twice.
"""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from batch_helpers import TINY, VOCAB, BatchEnv, start_worker, wait_for
from sqlalchemy import select, text

from robot_llm.commands.main import main
from robot_llm.forecasts import Forecasts
from robot_llm.night.worker import run_queue
from robot_llm.store.db import GenerationRequest, Thesis, session_scope, utcnow

pytestmark = pytest.mark.slow

N = 3  # instruments per night: one batch holds them all (max_batch_size 8), or one each (1)


@pytest.fixture(scope="module")
def pristine_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny YaLM release converted once (fp16, with its block checksums)."""
    from robot_llm.llm.store.writer import convert

    path = tmp_path_factory.mktemp("honest") / "store"
    convert(TINY, path, dtype="fp16")
    return path


@pytest.fixture
def store(pristine_store: Path, tmp_path: Path) -> Path:
    """This test's own copy of the store, to damage."""
    path = tmp_path / "store"
    shutil.copytree(pristine_store, path)
    return path


def _sections(store: Path, batch: int = 8, **model: object) -> dict:
    """A night on the stream engine over ``store``; ``batch.lease`` long, so only a takeover frees a claim."""
    stream = {"backend": "stream", "checkpoint": None, "store": str(store), "home": "disk", "max_batch_size": batch}
    return {"instruments": N, "model": stream | model, "batch": {"lease": "10m"}}


def _config(benv: BatchEnv, store: Path, batch: int, **model: object) -> Path:
    return benv.write_config(**_sections(store, batch, **model))


def _previous_night(benv: BatchEnv, store: Path, night: datetime) -> dict[str, int]:
    """A valid thesis per instrument from an earlier night (the one strategies read): ticker -> thesis id."""
    earlier = night - timedelta(hours=2)
    benv.seed(N, earlier)
    summary = run_queue(benv.config(**_sections(store)), benv.engine, as_of=earlier, progress=False, preflight=False)
    assert summary.done == N
    return _latest(benv)


def _latest(benv: BatchEnv) -> dict[str, int]:
    with Forecasts.open(benv.db_url) as fc:
        found = {f"T{i:03d}": fc.latest(f"T{i:03d}", utcnow()) for i in range(N)}
    return {t: r.id for t, r in found.items() if r is not None}


def _assert_nothing_invalid(benv: BatchEnv) -> None:
    for t in benv.theses():
        assert t.text.strip(), t
        assert all(math.isfinite(v) for v in t.label_logprobs.values()), t
        assert t.stance is None or (math.isfinite(t.stance) and -1 <= t.stance <= 1), t
    ids = [t.request_id for t in benv.theses()]
    assert len(ids) == len(set(ids))
    assert set(ids) == {r.id for r in benv.requests() if r.status == "done"}


def _night_theses(benv: BatchEnv, night: datetime) -> list[Thesis]:
    return [t for t in benv.theses() if t.as_of == night]


@dataclass
class Result:
    """One ``robot-llm batch run`` through the CLI's entry point (in this process: no interpreter start-up)."""

    returncode: int
    stdout: str
    stderr: str


def _batch_run(capsys: pytest.CaptureFixture[str], config: Path, night: datetime, *extra: str) -> Result:
    capsys.readouterr()
    code = main(["batch", "run", "-c", str(config), "--as-of", night.isoformat(), *extra])
    out, err = capsys.readouterr()
    return Result(code, out, err)


def _rerun_completes(benv: BatchEnv, capsys: pytest.CaptureFixture[str], config: Path, night: datetime) -> None:
    """An immediate rerun (no wait for leases) finishes the night in one go: every request done once."""
    done = _batch_run(capsys, config, night, "--skip-preflight")
    assert done.returncode == 0, done.stderr
    requests = [r for r in benv.requests() if r.as_of == night]
    assert [r.status for r in requests] == ["done"] * N, [(r.status, r.last_error) for r in requests]
    assert len(_night_theses(benv, night)) == N
    _assert_nothing_invalid(benv)


def _xor(path: Path, offset: int, length: int = 16) -> None:
    data = bytearray(path.read_bytes())
    offset = offset % len(data)
    for i in range(offset, min(offset + length, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- damaged weights


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("name", "where", "batch"),
    [
        ("layer_001.safetensors", 0.6, 8),  # the data section, one batch per night
        ("layer_000.safetensors", -1, 1),  # the file's last byte, one request per batch
        ("output.safetensors", 0.5, 8),  # a resident module (read when the model opens)
    ],
)
def test_a_damaged_store_file_fails_the_night_before_anything_is_stored(capsys, benv, store, night, name, where, batch):
    previous = _previous_night(benv, store, night)
    config = _config(benv, store, batch)
    benv.seed(N, night)
    pristine = (store / name).read_bytes()
    size = len(pristine)
    _xor(store / name, int(size * where) if where >= 0 else size - 1, 1 if where < 0 else 4096)

    failed = _batch_run(capsys, config, night, "--skip-preflight")  # the stream itself must catch it

    assert failed.returncode == 2, failed.stderr
    assert name in failed.stderr and "checksum" in failed.stderr
    assert _night_theses(benv, night) == []
    assert {r.status for r in benv.requests() if r.as_of == night} == {"pending"}  # given back, not failed
    assert _latest(benv) == previous
    _assert_nothing_invalid(benv)

    (store / name).write_bytes(pristine)  # repaired (a convert again does the same)
    _rerun_completes(benv, capsys, config, night)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_preflight_and_doctor_catch_a_damaged_block_without_the_night(capsys, benv, store, night):
    from robot_llm.night.preflight import doctor

    config = _config(benv, store, 8)
    benv.seed(N, night)
    _xor(store / "layer_001.safetensors", 9000)
    checks = {c.name: c for c in doctor(config)}
    assert checks["weights"].ok is False and "layer_001.safetensors" in checks["weights"].message

    refused = _batch_run(capsys, config, night)  # with the preflight, as the daemon's child runs
    assert refused.returncode == 2 and "preflight failed" in refused.stderr
    assert benv.theses() == []


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_truncated_layer_fails_the_night_and_nothing_is_stored(capsys, benv, store, night):
    previous = _previous_night(benv, store, night)
    config = _config(benv, store, 8)
    benv.seed(N, night)
    path = store / "layer_001.safetensors"
    pristine = path.read_bytes()
    path.write_bytes(pristine[: len(pristine) - 100])

    failed = _batch_run(capsys, config, night, "--skip-preflight")

    assert failed.returncode == 2, failed.stderr
    assert "layer_001.safetensors" in failed.stderr
    assert _night_theses(benv, night) == [] and _latest(benv) == previous
    path.write_bytes(pristine)
    _rerun_completes(benv, capsys, config, night)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("where", ["value", "syntax"])
def test_a_damaged_manifest_is_refused_when_the_model_opens(capsys, benv, store, night, where):
    config = _config(benv, store, 8)
    benv.seed(N, night)
    manifest = store / "manifest.json"
    pristine = manifest.read_text()
    if where == "value":  # still valid JSON, still the same shapes: a silently different model
        damaged = pristine.replace('"layernorm_epsilon": 1e-05', '"layernorm_epsilon": 1e-03', 1)
    else:
        damaged = pristine.replace("{", "[", 1)
    assert damaged != pristine
    manifest.write_text(damaged)

    failed = _batch_run(capsys, config, night, "--skip-preflight")

    assert failed.returncode == 2, failed.stderr
    assert "manifest" in failed.stderr
    assert benv.theses() == []
    manifest.write_text(pristine)
    _rerun_completes(benv, capsys, config, night)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_damaged_tokenizer_never_stores_an_invalid_thesis(capsys, benv, store, night, tmp_path):
    vocab = tmp_path / "voc.sp"
    data = bytearray(VOCAB.read_bytes())
    data[len(data) // 2] ^= 0xFF
    vocab.write_bytes(bytes(data))
    config = _config(benv, store, 8, vocab=str(vocab))
    benv.seed(N, night)

    result = _batch_run(capsys, config, night, "--skip-preflight")

    requests = [r for r in benv.requests() if r.as_of == night]
    if result.returncode == 0:  # the byte was inside a piece's text: a different tokenizer, still a valid night
        assert [r.status for r in requests] == ["done"] * N
    else:
        assert result.returncode in (1, 2) and result.stderr.strip()
    _assert_nothing_invalid(benv)
    vocab.write_bytes(VOCAB.read_bytes())
    if result.returncode != 0:
        _rerun_completes(benv, capsys, config, night)


def _with_nan_weights(store: Path, layer: int) -> None:
    """NaN inside one layer's weights, with checksums that match: a source that held NaN, faithfully converted."""
    from dataclasses import replace

    from robot_llm.llm.store.checksum import file_digests
    from robot_llm.llm.store.layout import save_aligned, write_json_atomic
    from robot_llm.llm.store.reader import MANIFEST, Store

    opened = Store(store)
    name = f"layer_{layer:03d}.safetensors"
    params = {k: v.clone() for k, v in opened.load("layer", layer).items()}
    key = next(k for k, v in params.items() if v.dim() == 2)
    params[key][0, 0] = float("nan")
    save_aligned(params, store / name)
    sha, blocks = file_digests(store / name)
    files = [
        replace(f, size=(store / name).stat().st_size, sha256=sha, blocks=tuple(blocks)) if f.name == name else f
        for f in opened.manifest.files
    ]
    write_json_atomic(store / MANIFEST, replace(opened.manifest, files=files).to_json())


@pytest.mark.parametrize("empty_db_url", ["sqlite", "postgresql"], indirect=True)
def test_nan_weights_fail_the_batch_at_once_naming_the_first_nonfinite_layer(
    capsys, benv, store, pristine_store, night
):
    previous = _previous_night(benv, store, night)
    config = _config(benv, store, 8)
    benv.seed(N, night)
    _with_nan_weights(store, 1)

    failed = _batch_run(capsys, config, night)  # the preflight passes: the bytes are what convert wrote

    assert failed.returncode == 2, failed.stderr
    assert "non-finite" in failed.stderr and "layer 1" in failed.stderr
    assert _night_theses(benv, night) == [] and _latest(benv) == previous
    assert {r.status for r in benv.requests() if r.as_of == night} == {"pending"}
    shutil.rmtree(store)
    shutil.copytree(pristine_store, store)
    _rerun_completes(benv, capsys, config, night)


def test_the_in_memory_model_names_the_first_nonfinite_layer(tiny_config, tokenizer):
    from robot_llm.llm.engine.finite import NonFiniteError
    from robot_llm.llm.engine.memory import Yalm
    from robot_llm.llm.generate import SamplingParams, generate

    model = Yalm.from_release(str(TINY / "weights"), tiny_config)
    layer = model.weights.layers[1]
    key = next(k for k, v in layer.items() if v.dim() == 2)
    layer[key][3, 3] = float("inf")
    layer[key][4, 4] = float("-inf")
    with pytest.raises(NonFiniteError) as info:
        generate(model, tokenizer, ["T000 news:"], [SamplingParams(max_new_tokens=3, greedy=True)])
    assert info.value.where == "layer 1" and "layer 1" in str(info.value)


# --------------------------------------------------------------------------- the store boundary


# Every character a first token can start with: the thesis is cut before its first character.
_STOP_ALL = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0x400, 0x500)] + ["▁", "\n"]


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_an_empty_thesis_is_refused_at_the_store_and_the_previous_one_stays_the_latest(capsys, benv, store, night):
    previous = _previous_night(benv, store, night)
    benv.seed(N, night)
    with session_scope(benv.engine) as s:  # a template whose stop strings leave no text at all
        for r in s.scalars(select(GenerationRequest).where(GenerationRequest.as_of == night)):
            r.params = {**r.params, "stop": _STOP_ALL}

    result = _batch_run(capsys, _config(benv, store, 8), night, "--skip-preflight")

    assert result.returncode == 1, result.stderr
    assert "empty thesis" in result.stdout
    assert _night_theses(benv, night) == []
    assert {r.status for r in benv.requests() if r.as_of == night} == {"failed"}
    assert _latest(benv) == previous
    _assert_nothing_invalid(benv)


def test_the_store_boundary_itself_refuses_an_invalid_row(benv, night):
    from robot_llm.night.queue import RequestQueue, Tally
    from robot_llm.thesis.validity import thesis_problem

    asks = {"stance": {"cue": "Outlook:", "labels": {" up": 1.0, " down": -1.0}}}
    good = {"text": "up", "stance": 0.5, "score": 0.7, "label_logprobs": {" up": -0.1, " down": -2.0}, "params": asks}
    assert thesis_problem(good) is None
    assert thesis_problem({"text": "no stance asked", "stance": None, "label_logprobs": {}, "params": {}}) is None
    # A stance-only template writes no text; an explicit "no inputs" abstention carries nothing.
    assert thesis_problem({**good, "text": "", "params": {**asks, "max_new_tokens": 0}}) is None
    assert thesis_problem({**good, "stance": None, "params": {**asks, "max_new_tokens": 0}})
    assert thesis_problem({"text": "", "stance": None, "label_logprobs": {}, "kind": "no_inputs"}) is None
    assert thesis_problem({**good, "kind": "no_inputs"})
    for bad in (
        {**good, "text": "  "},
        {**good, "label_logprobs": {" up": float("nan"), " down": -1.0}},
        {**good, "stance": float("inf")},
        {**good, "stance": 1.5},
        {**good, "stance": None},
        {**good, "score": float("nan")},
    ):
        assert thesis_problem(bad), bad
    (request_id,) = benv.seed(1, night)
    queue = RequestQueue(benv.config(), benv.engine, "w", None)
    queue.run_id = queue.start_run(1)
    row = {"request_id": request_id, "params": {"stance": {}}, "text": "", "stance": None, "label_logprobs": {}}
    with pytest.raises(ValueError, match="invalid thesis"):
        queue.store([row], Tally(), 1)
    assert benv.theses() == []


# --------------------------------------------------------------------------- killed workers


def _running(benv: BatchEnv) -> bool:
    return benv.status_counts().get("running", 0) > 0


def _blocked_storing(benv: BatchEnv) -> bool:
    """PostgreSQL: the worker's INSERT INTO theses waits on our lock (it is inside its store transaction)."""
    with benv.engine.connect() as conn:
        waiting = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE '%INSERT INTO theses%'"
            )
        ).scalar_one()
    return bool(waiting)


@pytest.mark.parametrize(
    ("kill_at", "batch", "empty_db_url"),
    [
        ("claim", 8, "sqlite"),  # issue 23's case: one batch claims the whole night
        ("claim", 8, "postgresql"),
        ("claim", 1, "sqlite"),
        ("store", 8, "postgresql"),  # inside the store transaction (its INSERT waits on a lock)
        ("store", 1, "postgresql"),
        ("commit", 8, "sqlite"),
        ("commit", 1, "sqlite"),
    ],
    indirect=["empty_db_url"],
)
def test_sigkill_at_each_point_then_an_immediate_rerun_completes_the_night(capsys, benv, night, store, kill_at, batch):
    config = _config(benv, store, batch)
    benv.seed(N, night)
    lock = None
    if kill_at == "store":
        lock = benv.engine.connect()
        lock.execute(text("LOCK TABLE theses IN EXCLUSIVE MODE"))
    proc = start_worker(config, "--skip-preflight", "--as-of", night.isoformat())
    try:
        if kill_at == "claim":
            wait_for(lambda: _running(benv), proc, timeout=180)
        elif kill_at == "store":
            wait_for(lambda: _blocked_storing(benv), proc, timeout=180)
        else:
            wait_for(lambda: benv.thesis_count() >= (N if batch >= N else 1), proc, timeout=180)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if lock is not None:
            lock.rollback()
            lock.close()
    stored_before = {t.request_id: (t.id, t.available_at) for t in benv.theses()}
    _assert_nothing_invalid(benv)

    _rerun_completes(benv, capsys, config, night)  # at once (batch.lease is 10 minutes): the dead worker's claims

    after = {t.request_id: (t.id, t.available_at) for t in benv.theses()}
    assert {k: after[k] for k in stored_before} == stored_before  # nothing stored was touched


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_live_worker_elsewhere_keeps_its_lease(benv, night, store):
    """Takeover is for this host's dead workers only: a claim of another host waits for its lease."""
    from robot_llm.store.db import Run

    config = _config(benv, store, 8)
    ids = benv.seed(N, night)
    now = utcnow()
    with session_scope(benv.engine) as s:
        run = Run(
            kind="generate",
            status="running",
            started_at=now,
            heartbeat_at=now - timedelta(hours=1),  # silent, but on another host: not ours to declare dead
            host="another-host",
            pid=1,
            counts={"worker_id": "another-host:1:x"},
        )
        s.add(run)
        for r in s.scalars(select(GenerationRequest).where(GenerationRequest.id.in_(ids))):
            r.status, r.lease_owner, r.lease_expires_at, r.attempts = (
                "running",
                "another-host:1:x",
                now + timedelta(minutes=10),
                1,
            )
    summary = run_queue(benv.config(**_sections(store)), benv.engine, as_of=night, progress=False, preflight=False)
    assert summary.run_id is None and benv.thesis_count() == 0
    assert {(r.status, r.lease_owner) for r in benv.requests()} == {("running", "another-host:1:x")}
    assert config.is_file()


# --------------------------------------------------------------------------- redo


@pytest.mark.parametrize("empty_db_url", ["sqlite", "postgresql"], indirect=True)
def test_redo_makes_new_rows_committed_now_and_keeps_the_old_ones_in_the_history(benv, night, store, capsys):
    from robot_llm.commands.main import main

    config = _config(benv, store, 8)
    benv.seed(N, night)
    assert run_queue(benv.config(**_sections(store)), benv.engine, as_of=night, progress=False).done == N
    old = {t.ticker: t for t in benv.theses()}
    between = utcnow()
    time.sleep(0.05)

    assert main(["batch", "redo", "-c", str(config), "--as-of", night.isoformat(), "--ticker", "T001"]) == 0
    out = capsys.readouterr().out
    assert "1 request(s) queued again" in out and "T001 tiny #1" in out

    theses = benv.theses()
    assert len(theses) == N + 1  # the old rows stay
    new = next(t for t in theses if t.ticker == "T001" and t.id != old["T001"].id)
    assert new.available_at > old["T001"].available_at and new.as_of == night
    with Forecasts.open(benv.db_url) as fc:
        assert fc.latest("T001", utcnow()).id == new.id  # the redo is what strategies read now...
        assert fc.latest("T001", between).id == old["T001"].id  # ...and a backtest before it saw the old one
        assert fc.latest("T000", utcnow()).id == old["T000"].id
        assert len(fc.history("T001", night - timedelta(hours=1), utcnow() + timedelta(seconds=1))) == 2
    _assert_nothing_invalid(benv)
    # Twice is a second redo, not a clash with the first.
    assert main(["batch", "redo", "-c", str(config), "--as-of", night.isoformat(), "--ticker", "T001"]) == 0
    assert {r.redo for r in benv.requests() if r.ticker == "T001"} == {0, 1, 2}
    assert main(["batch", "redo", "-c", str(config), "--as-of", night.isoformat(), "--ticker", "NOPE"]) == 2
    assert "no requests for NOPE" in capsys.readouterr().err


def test_torch_stays_off_the_read_and_report_paths():
    # The new report health, redo and thesis checks must not pull the model stack in.
    code = (
        "import sys, robot_llm.report.health, robot_llm.night.redo, robot_llm.thesis.validity, robot_llm.forecasts;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=TINY.parents[2]).returncode == 0


# --------------------------------------------------------------------------- disk full


@pytest.mark.parametrize("full_at", ["claim", "store"])
def test_disk_full_with_one_batch_per_night_then_an_immediate_rerun_completes(
    small_disk, tmp_path, night, pristine_store, capsys, full_at
):
    from batch_helpers import sqlite_env_on

    from robot_llm.night.preflight import doctor
    from tests.conftest import fill_disk

    benv = sqlite_env_on(small_disk, tmp_path)
    engine = benv.engine
    config = _config(benv, pristine_store, 8)
    benv.seed(N, night)
    try:
        lock = None
        if full_at == "claim":
            filler = fill_disk(small_disk, leave=0)
        proc = start_worker(config, "--skip-preflight", "--as-of", night.isoformat())
        if full_at == "store":  # claimed; its store (or a heartbeat) waits behind our lock while the disk fills
            wait_for(lambda: _running(benv), proc, timeout=180)
            lock = engine.connect()
            lock.exec_driver_sql("BEGIN IMMEDIATE")
            filler = fill_disk(small_disk, leave=0)
            lock.rollback()
            lock.close()
        _, err = proc.communicate(timeout=180)
        assert proc.returncode != 0 and "full" in err, err
        _assert_nothing_invalid(benv)
        pending = {c.name: c for c in doctor(config)}["disk"]
        assert pending.ok is False and "0 pending" not in pending.message, pending.message

        filler.unlink()  # space is back
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        _rerun_completes(benv, capsys, config, night)
    finally:
        engine.dispose()
