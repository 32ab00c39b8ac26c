"""Preflight: one clear failed check per cause, before anything heavy; run_queue refuses to start."""

from __future__ import annotations

import re
import uuid

import pytest
from batch_helpers import TINY, TINY_TEMPLATE

from robot_llm.commands.main import main
from robot_llm.night.preflight import PreflightError, doctor, preflight
from robot_llm.night.worker import run_queue

SQLITE_ONLY = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)


def _by_name(checks):
    return {c.name: c for c in checks}


def _failed(checks):
    return {c.name for c in checks if c.ok is False}


def test_a_good_setup_passes_every_check(benv):
    checks = preflight(benv.config())
    assert [c.name for c in checks] == [
        "queue",  # first: how the latest night stands (none planned here)
        "config",
        "database",
        "schema",
        "disk",
        "weights",
        "vocab",
        "memory",
        "templates",
        "stance",  # the label priors the last night measured (none yet here), after the templates
    ]
    assert _failed(checks) == set()
    assert _by_name(checks)["templates"].ok is True and _by_name(checks)["memory"].ok is True
    # The night's plan comes with the rates it was made with, measured at the threads it computes with.
    memory = _by_name(checks)["memory"].message
    threads = re.search(r"\n\s+(\d+) compute thread\(s\)", memory)
    assert threads is not None
    assert re.search(
        rf"rates: disk [\d.]+ GB/s \((measured under the store|assumed[^)]*)\), RAM read [\d.]+ GB/s "
        rf"\(measured at {threads[1]} threads?\), CPU fp32 [\d.]+ TFLOP/s \(measured at {threads[1]} ",
        memory,
    )


@SQLITE_ONLY
def test_invalid_config_is_one_located_failure(benv, capsys):
    path = benv.write_config()
    path.write_text(path.read_text() + "batch:\n  max_attempts: lots\n", encoding="utf-8")
    (check,) = doctor(path)
    assert check.name == "config" and check.ok is False and str(path) in check.message
    assert main(["doctor", "-c", str(path)]) == 1
    assert "FAIL config" in capsys.readouterr().out


@SQLITE_ONLY
def test_unreachable_database(benv):
    checks = _by_name(preflight(benv.config(database={"url": "postgresql://postgres@127.0.0.1:1/test"})))
    assert checks["database"].ok is False and "cannot connect" in checks["database"].message
    assert checks["schema"].ok is None
    assert checks["weights"].ok is True  # the other checks still run


def test_database_not_migrated(benv, tmp_path):
    if benv.kind == "sqlite":
        url, schema = f"sqlite:///{tmp_path / 'fresh.sqlite'}", None
    else:
        schema = f"fresh_{uuid.uuid4().hex[:12]}"
        with benv.engine.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = re.sub(r"search_path%3D\w+", f"search_path%3D{schema}", benv.db_url)
    try:
        checks = _by_name(preflight(benv.config(database={"url": url})))
    finally:
        if schema:
            with benv.engine.begin() as conn:
                conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
    assert checks["database"].ok is True
    assert checks["schema"].ok is False and "never migrated" in checks["schema"].message
    assert "robot-llm db upgrade" in checks["schema"].message


@SQLITE_ONLY
def test_store_missing_corrupt_and_deep_verified(benv, tmp_path):
    from robot_llm.llm.store.writer import convert

    store = tmp_path / "store"
    stream = {"backend": "stream", "store": str(store), "dtype": "fp32"}
    missing = _by_name(preflight(benv.config(model=stream)))["weights"]
    assert missing.ok is False and "manifest.json does not exist" in missing.message

    manifest = convert(TINY, store, dtype="fp32", reserve_bytes=0)
    assert _by_name(preflight(benv.config(model=stream)))["weights"].ok is True

    victim = store / manifest.files[-1].name
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: the last block's checksum (read by default) sees it
    victim.write_bytes(bytes(data))
    sampled = _by_name(preflight(benv.config(model=stream)))["weights"]
    assert sampled.ok is False and victim.name in sampled.message and "checksum" in sampled.message
    deep = _by_name(preflight(benv.config(model=stream), deep=True))["weights"]
    assert deep.ok is False and "sha256" in deep.message

    victim.write_bytes(bytes(data[:-10]))
    truncated = _by_name(preflight(benv.config(model=stream)))["weights"]
    assert truncated.ok is False and victim.name in truncated.message and "size" in truncated.message


@SQLITE_ONLY
def test_checkpoint_missing_a_module_file(benv, tmp_path):
    partial = tmp_path / "ckpt"
    (partial / "weights").mkdir(parents=True)
    (partial / "config.json").write_bytes((TINY / "config.json").read_bytes())
    for f in sorted((TINY / "weights").iterdir())[:-1]:
        (partial / "weights" / f.name).write_bytes(f.read_bytes())
    check = _by_name(preflight(benv.config(model={"checkpoint": str(partial)})))["weights"]
    assert check.ok is False and "layer_06-model_00-model_states.pt" in check.message


@SQLITE_ONLY
def test_vocab_missing_fails_and_run_queue_refuses_to_start(benv, tmp_path, night):
    config = benv.config(model={"vocab": str(tmp_path / "nope.sp")})
    checks = _by_name(preflight(config))
    assert checks["vocab"].ok is False and "nope.sp" in checks["vocab"].message
    benv.seed(2, night)
    with pytest.raises(PreflightError, match=r"vocab: model\.vocab"):
        run_queue(config, benv.engine, progress=False)
    assert benv.status_counts() == {"pending": 2} and benv.runs() == []


@SQLITE_ONLY
def test_template_that_does_not_render(benv):
    broken = TINY_TEMPLATE.replace("name: tiny", "name: broken").replace(
        "{{ instrument.ticker }}", "{{ instrument.ticker }} {{ no_such_variable }}"
    )
    (benv.prompts_dir / "broken.j2").write_text(broken, encoding="utf-8")
    check = _by_name(preflight(benv.config(prompts={"templates": ["tiny", "broken"]})))["templates"]
    assert check.ok is False and "broken" in check.message and "no_such_variable" in check.message


@SQLITE_ONLY
def test_template_that_cannot_fit_the_window(benv):
    long = TINY_TEMPLATE.replace("name: tiny", "name: long").replace(
        "{{ instrument.ticker }}", "{{ instrument.ticker }} " + "padding words " * 40
    )
    (benv.prompts_dir / "long.j2").write_text(long, encoding="utf-8")
    check = _by_name(preflight(benv.config(prompts={"templates": ["long"]})))["templates"]
    assert check.ok is False and "long" in check.message and "budget" in check.message


@SQLITE_ONLY
def test_memory_plan_that_does_not_fit(benv):
    check = _by_name(preflight(benv.config(model={"memory_budget": "1MiB"})))["memory"]
    assert check.ok is False and "does not fit" in check.message


@SQLITE_ONLY
def test_a_layer_pass_longer_than_the_stall_timeout_is_refused(benv):
    # The watchdog hears from the engine once per layer: a plan whose single layer pass outlasts
    # batch.stall_timeout would see every batch killed mid-prefill and retried until it fails.
    check = _by_name(preflight(benv.config(batch={"stall_timeout": 1e-9})))["memory"]
    assert check.ok is False and "batch.stall_timeout" in check.message and "one layer" in check.message
    assert "rates: disk" in check.message  # the estimate's rates, and where they came from


@SQLITE_ONLY
def test_doctor_command_passes_on_a_good_setup(benv, capsys):
    assert main(["doctor", "-c", str(benv.write_config())]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "FAIL" not in out
    # The plan the worker will open the model with, printed in full.
    assert "the night's plan:" in out and "weights homed in" in out and "compute thread(s)" in out


def test_preflight_writes_no_rows(benv):
    preflight(benv.config())
    with benv.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM runs").scalar_one() == 0
        assert conn.exec_driver_sql("SELECT count(*) FROM generation_requests").scalar_one() == 0


def _fake_gpu(monkeypatch, mem_get_info):
    """A CUDA device as torch reports it (no GPU here); ``mem_get_info`` answers for it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)


@SQLITE_ONLY
def test_doctor_does_not_probe_the_gpu_a_night_may_be_running_on(benv, monkeypatch):
    from robot_llm.llm.plan import rates

    rates.gpu_rates.cache_clear()
    _fake_gpu(monkeypatch, lambda device=None: (6 << 30, 8 << 30))
    check = _by_name(preflight(benv.config(model={"device": "auto"})))["memory"]
    assert check.ok is True, check.message
    assert "host-to-GPU 12.0 GB/s (assumed; the night measures it)" in check.message
    assert "GPU 30 TFLOP/s (assumed; the night measures it)" in check.message
    assert rates.gpu_rates.cache_info().currsize == 0  # the probe (~320 MiB on the GPU) never ran


@SQLITE_ONLY
def test_a_gpu_that_cannot_be_asked_fails_the_memory_check_in_one_line(benv, monkeypatch):
    def busy(device=None):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    _fake_gpu(monkeypatch, busy)
    check = _by_name(preflight(benv.config(model={"device": "auto"})))["memory"]
    assert check.ok is False and "\n" not in check.message
    assert check.message.startswith("the GPU (cuda) cannot be used: CUDA error: all CUDA-capable devices are busy")
    # Pinned to the CPU (as this suite's config is), the night and doctor never ask CUDA.
    assert _by_name(preflight(benv.config()))["memory"].ok is True
