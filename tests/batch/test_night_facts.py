"""Facts a night needs are derived once and passed down: the store's manifest read, the tokenizer
built and the templates loaded once per night, preflight included."""

from __future__ import annotations

from collections import Counter

import pytest
from batch_helpers import TINY

from robot_llm.llm import tokenizer
from robot_llm.llm.store import reader
from robot_llm.llm.store.writer import convert
from robot_llm.night.worker import run_queue
from robot_llm.prompting import loading


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_night_derives_its_facts_once(benv, night, tmp_path, monkeypatch):
    convert(TINY, tmp_path / "store", dtype="fp32", reserve_bytes=0)
    config = benv.config(model={"backend": "stream", "store": str(tmp_path / "store"), "checkpoint": None})
    benv.seed(3, night)
    derived: Counter[str] = Counter()
    parse = reader.Manifest.from_json.__func__
    build, load = tokenizer.load_tokenizer, loading.load_templates

    def manifest(cls, data):
        derived["manifest"] += 1
        return parse(cls, data)

    def tokenizer_(path):
        derived["tokenizer"] += 1
        return build(path)

    def templates(config):
        derived["templates"] += 1
        return load(config)

    # The night's users import these inside the functions that call them: they find the counted ones.
    monkeypatch.setattr(reader.Manifest, "from_json", classmethod(manifest))
    monkeypatch.setattr(tokenizer, "load_tokenizer", tokenizer_)
    monkeypatch.setattr(loading, "load_templates", templates)

    summary = run_queue(config, benv.engine, progress=False)  # with its preflight, as `batch run` does

    assert (summary.status, summary.done) == ("ok", 3)
    assert derived == {"manifest": 1, "tokenizer": 1, "templates": 1}
