"""Every ledger figure recomputed independently, from ``forecasts export`` and the CSV files, on SQLite and PostgreSQL.

The reference below is written from the definitions in robot_llm/track_record.py's docstring
(plain Python, its own CSV reading, its own ranks), not from the code under test.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import defaultdict
from datetime import date, datetime, time, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from track_helpers import DEMO_TICKERS, MSK, config_file, seed_nights, write_prices

from robot_llm.commands.main import main
from robot_llm.store.db import make_engine

FIRST = date(2026, 11, 2)
TOL = 1e-9


# --------------------------------------------------------------------------- the reference


def ref_closes(
    folder: Path, close_times: dict[str, time], default_close: time
) -> dict[str, list[tuple[datetime, float]]]:
    out: dict[str, list[tuple[datetime, float]]] = {}
    for path in folder.glob("*.csv"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for rec in csv.DictReader(f):
                raw = rec["time"]
                if len(raw) == 10:
                    when = datetime.combine(date.fromisoformat(raw), close_times.get(path.stem, default_close), MSK)
                else:
                    when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
                rows.append((when.astimezone(timezone.utc), float(rec["close"])))
        out[path.stem] = sorted(rows)
    return out


def export(cfg: Path, as_of: str, out: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert (
        main(
            [
                "forecasts",
                "export",
                "-c",
                str(cfg),
                "--since",
                "2000-01-01",
                "--until",
                as_of,
                "--format",
                "csv",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    with out.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["available_at"] = datetime.fromisoformat(r["available_at"])
        r["as_of"] = datetime.fromisoformat(r["as_of"])
        r["stance"] = None if r["stance"] == "" else float(r["stance"])
    return rows


def first_at_or_after(series: list[tuple[datetime, float]], moment: datetime) -> tuple[datetime, float] | None:
    for when, close in series:
        if when >= moment:
            return when, close
    return None


def ref_outcome(
    row: dict[str, Any], closes: dict[str, list], horizon: timedelta, as_of: datetime, benchmark: str | None
) -> float | None:
    known = {k: [(t, c) for t, c in v if t <= as_of] for k, v in closes.items()}
    series = known.get(row["ticker"], [])
    entry = first_at_or_after(series, row["available_at"])
    if entry is None:
        return None
    exit_ = first_at_or_after(series, entry[0] + horizon)
    if exit_ is None:
        return None
    ret = exit_[1] / entry[1] - 1
    if benchmark is not None:
        b_in, b_out = first_at_or_after(known[benchmark], entry[0]), first_at_or_after(known[benchmark], exit_[0])
        if b_in is None or b_out is None:
            return None
        ret -= b_out[1] / b_in[1] - 1
    return ret


def avg_ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + 1 + j + 1) / 2
        i = j + 1
    return ranks


def pearson(a: list[float], b: list[float]) -> float | None:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else None


def ref_figures(points: list[tuple[float, float, float | None]], min_count: int) -> dict[str, Any]:
    n = len(points)
    directional = [(s, r) for s, r, _ in points if s != 0 and r != 0]
    briers = [(p - (1.0 if r > 0 else 0.0)) ** 2 for _, r, p in points if p is not None and r != 0]
    out: dict[str, Any] = {"n": n, "hit_rate_n": len(directional), "brier_n": len(briers)}
    out["hit_rate"] = (
        sum((s > 0) == (r > 0) for s, r in directional) / len(directional) if len(directional) >= min_count else None
    )
    out["brier"] = sum(briers) / len(briers) if len(briers) >= min_count else None
    if n < min_count:
        out.update(ic=None, top_minus_bottom=None)
        return out
    stances, rets = [s for s, _, _ in points], [r for _, r, _ in points]
    rs = avg_ranks(stances)
    out["ic"] = pearson(rs, avg_ranks(rets))
    top = [r for r, rank in zip(rets, rs, strict=True) if n + 1 - rank <= n / 3]
    bottom = [r for r, rank in zip(rets, rs, strict=True) if rank <= n / 3]
    out["top_n"], out["bottom_n"] = len(top), len(bottom)
    out["top_minus_bottom"] = sum(top) / len(top) - sum(bottom) / len(bottom) if top and bottom else None
    return out


def reference(
    rows: list[dict[str, Any]],
    closes: dict,
    p_up: dict[int, float | None],
    horizon: timedelta,
    as_of: datetime,
    min_count: int,
    benchmark: str | None,
    since: datetime | None,
) -> dict:
    groups: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"points": [], "abstained": 0, "pending": 0})
    for row in rows:
        if since is not None and row["available_at"] <= since:
            continue
        ret = ref_outcome(row, closes, horizon, as_of, benchmark)
        for key in (
            (row["model_id"], row["template_name"], row["ticker"]),
            (row["model_id"], row["template_name"], None),
        ):
            g = groups[key]
            if ret is None:
                g["pending"] += 1
            elif row["stance"] is None:
                g["abstained"] += 1
            else:
                g["points"].append((row["stance"], ret, p_up[int(row["id"])]))
    return {
        k: {**ref_figures(g["points"], min_count), "abstained": g["abstained"], "pending": g["pending"]}
        for k, g in groups.items()
    }


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] is not None and abs(got[key] - value) <= TOL, (where, key, got[key], value)
        else:
            assert got[key] == value, (where, key, got[key], value)


# --------------------------------------------------------------------------- the checks


PRICES: dict[str, Any] = {
    "csv": "prices",
    "horizons": ["1d", "5d"],
    "min_count": 5,
    "window": "7d",
    "bootstrap": 200,
    "seed": 7,
    "close_times": {"YDEX": "19:00"},
}


def _setup(tmp_path: Path, db_url: str) -> tuple[dict[str, Path], dict[int, float | None], dict]:
    """Closes for the demo's instruments and an index, 12 nights of theses of three templates and two models.

    Two configs on the one database: returns raw, and returns minus the index's.
    """
    rng = random.Random(20261202)
    prices_dir = tmp_path / "prices"
    write_prices(prices_dir, rng, DEMO_TICKERS, date(2026, 11, 1), 40)
    write_prices(prices_dir, random.Random(5), ("IMOEX",), date(2026, 11, 1), 40)
    configs = {
        "raw": config_file(tmp_path, db_url, PRICES),
        "benchmark": config_file(tmp_path, db_url, {**PRICES, "benchmark": "IMOEX"}, name="bench.yaml"),
    }
    engine = make_engine(db_url)
    try:
        seeded = seed_nights(engine, rng, first=FIRST, nights=12, templates=("brief_en", "two_way"))
        seeded += seed_nights(engine, rng, first=FIRST, nights=12, templates=("five_way",), model="yalm-100b")
    finally:
        engine.dispose()
    assert main(["prices", "ingest", "-c", str(configs["benchmark"])]) == 0
    closes = ref_closes(prices_dir, {"YDEX": time(19, 0)}, time(18, 50))
    return configs, {s.id: s.p_up for s in seeded}, closes


def test_every_figure_matches_an_independent_computation(
    tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    configs, p_up, closes = _setup(tmp_path, db_url)
    capsys.readouterr()
    for variant, cfg in configs.items():
        for as_of in ("2026-11-12T12:00:00+03:00", "2026-11-20T18:50:00+03:00", "2027-01-31T00:00:00Z"):
            _check(tmp_path, cfg, as_of, "IMOEX" if variant == "benchmark" else None, p_up, closes, capsys)


def _check(
    tmp_path: Path,
    cfg: Path,
    as_of: str,
    bench: str | None,
    p_up: dict[int, float | None],
    closes: dict,
    capsys: pytest.CaptureFixture[str],
) -> None:
    moment = datetime.fromisoformat(as_of.replace("Z", "+00:00")).astimezone(timezone.utc)
    rows = export(cfg, as_of, tmp_path / "export.csv", capsys)
    # The export carries the up-probability the ledger uses: the label probability the stance came from.
    for r in rows:
        want = p_up[int(r["id"])]
        got = None if r["up_probability"] == "" else float(r["up_probability"])
        assert (got is None) == (want is None) and (want is None or abs(got - want) <= 1e-12), r

    assert main(["track-record", "-c", str(cfg), "--as-of", as_of, "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)
    checked = 0
    for horizon_text, horizon in (("1d", timedelta(days=1)), ("5d", timedelta(days=5))):
        full = reference(rows, closes, p_up, horizon, moment, 5, bench, None)
        recent = reference(rows, closes, p_up, horizon, moment, 5, bench, moment - timedelta(days=7))
        got = [g for g in ledger if g["horizon"] == horizon_text]
        assert {(g["model"], g["template"], g["ticker"]) for g in got} == set(full)
        for g in got:
            key = (g["model"], g["template"], g["ticker"])
            where = f"{cfg.name} as of {as_of}: {key} {horizon_text}"
            assert_same(g, full[key], f"{where} all time")
            window = recent.get(key, {"n": 0, "abstained": 0, "pending": 0})
            assert_same(g["window"], window, f"{where} window")
            for name in ("hit_rate", "ic", "top_minus_bottom", "brier"):
                if g[name] is None:
                    assert g[f"{name}_ci"] is None
                checked += g[name] is not None
            assert g["enough_data"] == (g["n"] >= 5)
    if as_of.startswith("2027"):
        assert checked > 100  # most groups have figures: the comparison is not vacuous
        # Five labels: the stored row does not determine the up-probability, so no Brier score.
        assert all(g["brier"] is None and g["brier_n"] == 0 for g in ledger if g["template"] == "five_way")


def test_intervals_are_seeded_and_over_nights(tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _setup(tmp_path, db_url)[0]["raw"]
    capsys.readouterr()
    args = ["track-record", "-c", str(cfg), "--as-of", "2027-01-31", "--json", "--horizon", "1d"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first
    overall = next(g for g in first if g["ticker"] is None and g["template"] == "brief_en")
    assert overall["ci_over"] == "nights" and overall["ci_level"] == 0.95
    lo, hi = overall["ic_ci"]
    assert -1 <= lo < hi <= 1
    text = cfg.read_text(encoding="utf-8").replace("seed: 7", "seed: 8")
    cfg.write_text(text, encoding="utf-8")
    assert main(args) == 0
    other = next(g for g in json.loads(capsys.readouterr().out) if g["ticker"] is None and g["template"] == "brief_en")
    assert other["ic"] == overall["ic"] and other["ic_ci"] != overall["ic_ci"]


def test_text_output_says_how_it_is_computed(tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _setup(tmp_path, db_url)[0]["raw"]
    capsys.readouterr()
    assert main(["track-record", "-c", str(cfg), "--as-of", "2026-11-09T12:00+03:00", "--horizon", "5d"]) == 0
    out = capsys.readouterr().out
    assert "first close at or after the thesis's available_at" in out
    assert "bootstrap over nights (200 resamples, seed 7)" in out
    assert "not enough data (fewer than 5 scored theses)" in out
    assert "brief_en (gemma-3-270m), horizon 5d:" in out
