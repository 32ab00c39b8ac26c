"""Facts a night needs are derived once and passed down: the store's manifest is read once per night."""

from __future__ import annotations

import pytest
from batch_helpers import TINY

from robot_llm.llm.store import reader
from robot_llm.llm.store.writer import convert
from robot_llm.night.worker import run_queue


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_night_reads_the_store_manifest_once(benv, night, tmp_path, monkeypatch):
    convert(TINY, tmp_path / "store", dtype="fp32", reserve_bytes=0)
    config = benv.config(model={"backend": "stream", "store": str(tmp_path / "store"), "checkpoint": None})
    benv.seed(3, night)
    reads = []
    parse = reader.Manifest.from_json.__func__

    def counted(cls, data):
        reads.append(data["dtype"])
        return parse(cls, data)

    monkeypatch.setattr(reader.Manifest, "from_json", classmethod(counted))

    summary = run_queue(config, benv.engine, progress=False)  # with its preflight, as `batch run` does

    assert (summary.status, summary.done) == ("ok", 3)
    assert reads == ["fp32"]
