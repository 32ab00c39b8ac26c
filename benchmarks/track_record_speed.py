"""Track-record speed: ``robot-llm track-record`` on 10,000 theses and 5 years of daily closes, on SQLite.

Builds a temporary SQLite database the way nights leave it (requests and theses with their
stance labels in ``params``) for ``--instruments`` instruments over ``--years`` years of
weekday nights, plus their daily closes, then times, each in a fresh process after one
untimed warm-up run of the same command:

* ``robot-llm track-record --json`` with the config's defaults (horizons 1d and 5d, 1,000
  bootstrap resamples over nights, a 90-day window);
* the same with ``--horizon 1d`` only;
* the same with ``prices.bootstrap: 0`` (the figures without intervals).

Wall time of the whole command (Python start-up and imports included) is the figure; the
target is under 2 s for the first row. Prints the CPU's features and the load average:
this machine is shared, so timings vary with the other sessions' load.

    python benchmarks/track_record_speed.py [--theses 10000] [--years 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LABELS = {" up": 1.0, " down": -1.0, " flat": 0.0}


def cpu_features() -> str:
    """The SIMD features that matter for numpy here, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "unknown"
    flags: set[str] = set()
    model = "unknown CPU"
    for line in text.splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.partition(":")[2].split())
        if line.startswith("model name"):
            model = line.partition(":")[2].strip()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return f"{model}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def build(folder: Path, theses: int, years: int, instruments: int, seed: int) -> Path:
    """The database and config; returns the config path."""
    from robot_llm.night.stance import stance_from_logprobs
    from robot_llm.store.db import GenerationRequest, Price, Thesis, make_engine
    from robot_llm.store.migrate import upgrade

    rng = random.Random(seed)
    url = f"sqlite:///{folder / 'bench.sqlite'}"
    upgrade(url)
    tickers = [f"T{i:02d}" for i in range(instruments)]
    first = date(2021, 1, 4)
    days = [first + timedelta(days=d) for d in range(365 * years + 10) if (first + timedelta(days=d)).weekday() < 5]
    nights = math.ceil(theses / instruments)
    if nights > len(days):
        raise SystemExit(f"{theses} theses need {nights} nights per instrument; {years} years have {len(days)}")
    engine = make_engine(url)
    now = datetime.now(timezone.utc)
    requests, rows, prices = [], [], []
    for t in tickers:
        price = 100.0
        for day in days:
            price *= math.exp(rng.gauss(0, 0.02))
            when = datetime(day.year, day.month, day.day, 15, 50, tzinfo=timezone.utc)
            prices.append({"ticker": t, "time": when, "close": round(price, 2), "source": "bench", "ingested_at": now})
    params = {"seed": 1, "stance": {"cue": "\nOutlook:", "labels": LABELS, "method": "sum"}}
    count = 0
    for day in days[:nights]:
        as_of = datetime(day.year, day.month, day.day, 20, 0, tzinfo=timezone.utc)
        for t in tickers:
            if count == theses:
                break
            count += 1
            result = stance_from_logprobs(list(LABELS.items()), [rng.uniform(-4, 0) for _ in LABELS])
            common = {"as_of": as_of, "ticker": t, "template_name": "brief_en", "template_version": "2"}
            requests.append(
                {
                    **common,
                    "id": count,
                    "prompt": "p",
                    "prompt_sha256": "0" * 64,
                    "prompt_tokens": 100,
                    "news_ids": [],
                    "signal_ids": [],
                    "params": params,
                    "valid_until": as_of + timedelta(days=1),
                    "status": "done",
                    "attempts": 1,
                    "created_at": now,
                    "updated_at": now,
                }
            )
            rows.append(
                {
                    **common,
                    "request_id": count,
                    "text": "t",
                    "stance": result.stance,
                    "stance_label": result.label,
                    "score": result.score,
                    "label_logprobs": {},
                    "model_id": "gemma-3-270m",
                    "params": params,
                    "seed": 1,
                    "prompt_sha256": "0" * 64,
                    "prompt_tokens": 100,
                    "completion_tokens": 20,
                    "finish_reason": "stop",
                    "generation_seconds": 1.0,
                    "news_ids": [],
                    "signal_ids": [],
                    "available_at": as_of + timedelta(minutes=rng.randint(5, 600)),
                    "valid_until": as_of + timedelta(days=1),
                }
            )
    with engine.begin() as conn:
        conn.execute(GenerationRequest.__table__.insert(), requests)
        conn.execute(Thesis.__table__.insert(), rows)
        conn.execute(Price.__table__.insert(), prices)
    engine.dispose()
    config = {
        "database": {"url": url},
        "timezone": "Europe/Moscow",
        "instruments": [{"ticker": t, "name": t} for t in tickers],
        "model": {"store": "store", "vocab": "voc.sp"},
        "prices": {"signal_price": "close", "horizons": ["1d", "5d"]},
    }
    path = folder / "bench.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    print(f"built {count} theses ({instruments} instruments x {nights} nights), {len(prices)} closes", flush=True)
    return path


def timed(command: list[str], repeat: int) -> tuple[float, float, float, int]:
    """(best wall, median wall, best CPU) seconds of ``command`` in fresh processes after one untimed warm-up.

    CPU is the child's user + system time: on a loaded machine it moves far less than wall time.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    warm = subprocess.run(command, capture_output=True, env=env, check=True)
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, env=env, check=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(walls), statistics.median(walls), min(cpus), len(warm.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--theses", type=int, default=10_000)
    parser.add_argument("--years", type=int, default=5)
    parser.add_argument("--instruments", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"CPU: {cpu_features()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: timings vary)")
    with tempfile.TemporaryDirectory(prefix="track-bench-") as tmp:
        cfg = build(Path(tmp), args.theses, args.years, args.instruments, args.seed)
        no_boot = Path(tmp) / "no-bootstrap.yaml"
        data = yaml.safe_load(cfg.read_text(encoding="utf-8"))
        data["prices"]["bootstrap"] = 0
        no_boot.write_text(yaml.safe_dump(data), encoding="utf-8")
        base = [sys.executable, "-m", "robot_llm.commands.main", "track-record", "--as-of", "2027-01-01", "--json"]
        configs = [
            ("defaults: horizons 1d+5d, 1000 resamples", [*base, "-c", str(cfg)]),
            ("--horizon 1d, 1000 resamples", [*base, "-c", str(cfg), "--horizon", "1d"]),
            ("horizons 1d+5d, no bootstrap", [*base, "-c", str(no_boot)]),
            ("robot-llm --version (start-up alone)", [sys.executable, "-m", "robot_llm.commands.main", "--version"]),
        ]
        results = {}
        print(f"\n{'configuration':<42} {'best s':>8} {'median s':>9} {'CPU s':>7}")
        for name, command in configs:
            best, median, cpu, size = timed(command, args.repeat)
            results[name] = {"best_s": round(best, 3), "median_s": round(median, 3), "cpu_s": round(cpu, 3)}
            results[name]["output_bytes"] = size
            print(f"{name:<42} {best:>8.3f} {median:>9.3f} {cpu:>7.3f}", flush=True)
    row = results["defaults: horizons 1d+5d, 1000 resamples"]
    verdict = "met" if row["best_s"] < 2 else "NOT met"
    print(
        f"\ntarget: under 2 s for the defaults; measured {row['best_s']:.3f} s wall, "
        f"{row['cpu_s']:.3f} s CPU ({verdict})"
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"theses": args.theses, "years": args.years, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
