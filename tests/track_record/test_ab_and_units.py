"""A/B of two templates (one database) and of two stores (two databases) on the same nights; the up-probability."""

from __future__ import annotations

import json
import math
import random
from datetime import date
from pathlib import Path

import pytest
from test_ledger import avg_ranks, pearson
from track_helpers import DEMO_TICKERS, LABELS, config_file, seed_nights, write_prices

from robot_llm.commands.main import main
from robot_llm.night.stance import stance_from_logprobs
from robot_llm.store.db import make_engine
from robot_llm.store.migrate import upgrade
from robot_llm.track.outcomes import up_probability


def _outcomes(cfg: Path, template: str | None, capsys) -> dict[tuple[str, str], dict]:
    args = ["track-record", "-c", str(cfg), "--as-of", "2027-01-31", "--outcomes", "--horizon", "1d"]
    assert main(args + (["--template", template] if template else [])) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    return {(r["ticker"], r["night"]): r for r in rows if r["stance"] is not None}


def _ic(pairs: list[dict]) -> float:
    return pearson(avg_ranks([p["stance"] for p in pairs]), avg_ranks([p["return"] for p in pairs]))


def test_two_templates_on_the_same_nights(tmp_path: Path, db_url: str, capsys) -> None:
    rng = random.Random(3)
    write_prices(tmp_path / "prices", rng, DEMO_TICKERS, date(2026, 11, 1), 40)
    cfg = config_file(tmp_path, db_url, {"csv": "prices", "min_count": 5, "bootstrap": 300})
    engine = make_engine(db_url)
    try:
        seed_nights(engine, rng, first=date(2026, 11, 2), nights=12, templates=("brief_en", "brief_ru"))
    finally:
        engine.dispose()
    assert main(["prices", "ingest", "-c", str(cfg)]) == 0
    capsys.readouterr()
    a, b = _outcomes(cfg, "brief_en", capsys), _outcomes(cfg, "brief_ru", capsys)
    common = sorted(set(a) & set(b))
    assert len(common) > 30

    args = ["track-record", "-c", str(cfg), "--as-of", "2027-01-31", "--ab", "brief_en", "brief_ru", "--json"]
    assert main([*args, "--horizon", "1d"]) == 0
    result = json.loads(capsys.readouterr().out)
    overall = next(r for r in result["rows"] if r["ticker"] is None)
    assert overall["pairs"] == len(common)
    want_a, want_b = _ic([a[k] for k in common]), _ic([b[k] for k in common])
    assert abs(overall["a"]["ic"] - want_a) <= 1e-9 and abs(overall["b"]["ic"] - want_b) <= 1e-9
    assert abs(overall["diff"]["ic"] - (want_b - want_a)) <= 1e-9
    lo, hi = overall["diff"]["ic_ci"]
    assert lo < hi
    assert main([*args, "--horizon", "1d"]) == 0
    assert json.loads(capsys.readouterr().out) == result  # seeded: the same interval again
    assert main([*args[:-1], "--horizon", "1d"]) == 0
    assert "B - A: hit" in capsys.readouterr().out


def test_two_stores_in_two_databases(tmp_path: Path, db_url: str, capsys) -> None:
    rng = random.Random(4)
    write_prices(tmp_path / "prices", rng, DEMO_TICKERS, date(2026, 11, 1), 40)
    cfg = config_file(tmp_path, db_url, {"csv": "prices", "min_count": 5, "bootstrap": 100})
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_url = f"sqlite:///{other_dir / 'other.sqlite'}"
    upgrade(other_url)
    other = config_file(other_dir, other_url, {})
    for url, model in ((db_url, "store-a"), (other_url, "store-b")):
        engine = make_engine(url)
        try:
            seed_nights(engine, random.Random(model), first=date(2026, 11, 2), nights=8, model=model)
        finally:
            engine.dispose()
    assert main(["prices", "ingest", "-c", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["track-record", "-c", str(cfg), "--as-of", "2027-01-31", "--ab-config", str(other), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["b"] == str(other)
    overall = [r for r in result["rows"] if r["ticker"] is None]
    assert [r["horizon"] for r in overall] == ["1d"]
    assert overall[0]["pairs"] > 20 and overall[0]["diff"]["ic"] is not None


@pytest.mark.parametrize("template", ["brief_en", "two_way", "brief_ru"])
def test_up_probability_is_recovered_exactly(template: str) -> None:
    rng = random.Random(template)
    labels = LABELS[template]
    up = max(labels, key=labels.get)
    for _ in range(300):
        logprobs = [rng.uniform(-8, 0) for _ in labels]
        r = stance_from_logprobs(list(labels.items()), logprobs)
        weights = [math.exp(x) for x in logprobs]
        want = weights[list(labels).index(up)] / sum(weights)
        assert abs(up_probability(r.stance, r.label, r.score, labels) - want) < 1e-12


def test_no_up_probability_without_one() -> None:
    five = LABELS["five_way"]
    assert up_probability(0.2, "a", 0.5, five) is None
    assert up_probability(None, None, None, LABELS["brief_en"]) is None
    assert up_probability(0.2, "up", 0.5, None) is None
    assert up_probability(0.2, "up", 0.5, {" up": -1.0, " down": -2.0}) is None  # no label says "up"


def test_read_api_track_record_stays_torch_free(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'light.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        seed_nights(engine, random.Random(1), first=date(2026, 11, 2), nights=2, tickers=("SBER",))
    finally:
        engine.dispose()
    cfg = config_file(tmp_path, url, {"csv": "prices"}, ("SBER",))
    code = (
        "import sys\nfrom datetime import datetime, timezone\nfrom robot_llm.forecasts import Forecasts\n"
        f"with Forecasts.from_config({str(cfg)!r}) as fc:\n"
        "    rows = fc.track_record(datetime(2027, 1, 1, tzinfo=timezone.utc))\n"
        "print(len(rows), rows[0].all_time.pending)\n"
        "print([m for m in ('torch', 'deepspeed', 'pandas', 'plotly', 'jinja2') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["2 2", "[]"]
