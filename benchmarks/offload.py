"""Offload benchmark: the streaming engine per weight dtype vs DeepSpeed ZeRO-Inference, honestly.

A mid-size YaLM config with random weights is written to one store per weight
dtype (fp32, bf16, int8, int4). Every configuration then runs **in its own
fresh process**, with the same intra-op thread count, an untimed warm-up pass
first, the store's page cache dropped, and the night's work inside the timed
region: greedy generation of ``new`` tokens for every prompt, then the stance
of every row scored the way the worker does it now, from the row's KV cache
(one more pass of the batch over the cue and the label pieces).

Rows: the engine with weights cold on disk at batch 1 and 32 for each dtype
(fp32 computed in fp32; bf16/int8/int4 in bf16 where the CPU has it natively,
else fp32): these stream every layer every pass, whatever RAM the machine has.
The fp32, bf16 and int4 models held in RAM by the engine (loaded untimed): the
bound. The fp32 and bf16 engines opened the way a night opens them
(:meth:`robot_llm.llm.model.Model.open`: the plan applied, its weight home,
KV dtype, micro-batch and batch size, at most 32, chosen within a RAM budget;
the 32 prompts run in the planned batches), in two budgets: one that
holds about half the layers in RAM (a split) and this machine's RAM (all in
RAM); for these the store's page cache is dropped before the model opens and
the opening (reading the RAM-homed layers from cold disk, ``load s``) is
counted in the row's time. And DeepSpeed ZeRO-3 with NVMe parameter offload in
fp32 and bf16. Next to each: where its weights live, the raw read bandwidth
measured right before it with 16 requests in flight (fio's queue depth), the
measured decode step and its roofline (max of the bytes the step streams over
that bandwidth and its FLOPs over the GEMM rate measured in the same setting),
and peak RSS (``VmHWM``) against the planner's estimate for that row (the plan
rows': the plan the door applied). Headline ratios come from these fresh
processes only. Two more rows time a night's real work (:mod:`night`:
thesis_ru prompts, stance re-prefilled per thesis as before vs scored from the
KV cache as now) and count its weight passes. The last line is one JSON object.

    python benchmarks/offload.py [--quick] [--dir WORK_DIR] [--threads N] [--rows fp32_b1,int4_b1,...] [--repeat N]

``--repeat N`` runs every row N times, in N rounds over all rows (so a slow minute
does not fall on one configuration only); each row reports its fastest run, its
spread (slowest over fastest) and the highest peak RSS of its runs.

``--rows`` runs only the named engine rows (``DTYPE_bBATCH``, ``DTYPE_ram_b32``,
``DTYPE_plan_half_b32``, ``DTYPE_plan_b32``, ``ds_DTYPE_bBATCH``), in that order,
and no night rows.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from robot_llm.llm.engine.runtime import night_work, plan_run
from robot_llm.llm.families.config import ModuleKind, module_plan
from robot_llm.llm.families.family import Params
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.model import Model, ModelSettings, Policy
from robot_llm.llm.plan.cpu import cpu_has_native_bf16
from robot_llm.llm.plan.machine import Machine, detect_machine
from robot_llm.llm.plan.planner import HEADROOM, Work, plan
from robot_llm.llm.plan.rates import gemm_flops
from robot_llm.llm.plan.sizes import layer_bytes, layer_params
from robot_llm.llm.store.diskio import drop_page_cache, measure_read_bandwidth
from robot_llm.llm.store.reader import Store
from robot_llm.llm.store.writer import write_store

BENCHMARKS = Path(__file__).resolve().parent  # holds night.py (no package): imported only by the night rows

_MID = {"hidden_size": 1024, "embedding_size": 256, "intermediate_size": 2730, "num_attention_heads": 16}
SIZES: dict[str, dict[str, Any]] = {
    "full": {"layers": 12, "prompt": 8, "new": 32, "batches": (1, 32), "dtypes": ("fp32", "bf16", "int8", "int4")},
    "quick": {"layers": 4, "prompt": 4, "new": 8, "batches": (1, 32), "dtypes": ("fp32", "int4")},
}
NIGHT_BATCH = {"full": 8, "quick": 4}
LABELS = 3  # stance continuations per request (рост / падение / нейтрально)
CUE = 6  # tokens of the stance cue appended to prompt + thesis


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_modules(cfg: YalmConfig) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Release-shaped random modules, one at a time (the same weights for every store dtype)."""
    g = torch.Generator().manual_seed(0)
    for kind, index, shapes in module_plan(cfg):
        params = {}
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=g)
            params[name] = t * 0.02 if len(shape) == 2 else 1.0 + 0.1 * t if name.endswith("norm.weight") else t * 0.1
        yield kind, index, params


def peak_rss() -> int:
    """This process image's peak resident set (bytes): ``VmHWM``, not ``ru_maxrss``.

    Linux carries ``ru_maxrss`` across fork + exec, so a child would report its parent's
    high-water mark when that is higher (the parent that wrote the stores peaks near 0.4 GiB).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compute_dtype(store_dtype: str) -> str:
    """fp32 stores compute in fp32; the others in bf16 where the CPU has it natively (the plan's auto)."""
    return "fp32" if store_dtype == "fp32" or not cpu_has_native_bf16() else "bf16"


def night_settings(spec: dict[str, Any], budget: int | None) -> ModelSettings:
    """How a night opens the model for this row's work (:meth:`robot_llm.llm.model.Model.open`): planned
    within ``budget`` bytes of RAM, its work (:func:`night_work`) exactly the benchmark's."""
    return ModelSettings(
        vocab=Path(spec["vocab"]),
        backend="stream",
        store=Path(spec["store"]),
        device="cpu",
        dtype=spec["dtype"],
        threads=spec["threads"],
        max_batch_size=spec.get("max_batch", spec["batch"]),
        memory_budget_bytes=budget,
        max_new_tokens=spec["new"],
        stance_tokens=CUE + LABELS,
        max_positions=spec["prompt"] + spec["new"] + CUE + LABELS,
    )


def half_layers_budget(spec: dict[str, Any]) -> int:
    """A RAM budget under which the plan holds about half the layers in RAM and streams the rest.

    The planner's own estimate: its disk-home plan's RAM total plus half the layers' stored
    bytes (its KV cache in the dtype the plan under that budget picks), over the usable share
    of RAM a plan may fill (:data:`~robot_llm.llm.plan.planner.HEADROOM`). A split keeps
    two staging slots: with 4 layers (``--quick``) half of them cost what all of them do, and
    that plan holds them all; the split shows in the full run's 12.
    """
    settings = night_settings(spec, None)
    store = Store(spec["store"])
    cfg, dtype = store.config, store.manifest.dtype
    work = night_work(settings, cfg)
    kv_dtype = "auto"
    for _ in range(3):  # a tight budget may compress the KV cache, which frees RAM for more layers: plan with it
        disk = plan_run(replace(settings, home="disk", kv_dtype=kv_dtype), cfg, work, dtype)
        need = sum(disk.memory["ram"].values()) + cfg.num_layers // 2 * layer_bytes(cfg, dtype)
        budget = math.ceil(need / HEADROOM) + 4096
        chosen = plan_run(replace(settings, memory_budget_bytes=budget), cfg, work, dtype)
        if chosen.kv_dtype == disk.kv_dtype:
            break
        kv_dtype = chosen.kv_dtype
    return budget


# --------------------------------------------------------------------------- child process


def night(model: Any, cfg: YalmConfig, prompts: int, prompt: int, new: int, batch: int) -> dict[str, float]:
    """The timed work: generate, then score every row's stance from its cache. Returns the phase times."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (prompts, prompt), generator=g)
    started = time.perf_counter()
    decode, steps, stance = 0.0, 0, 0.0
    for start in range(0, prompts, batch):
        chunk = ids[start : start + batch]
        cache = model.new_cache(chunk.shape[0], prompt + new - 1 + CUE + LABELS)
        logits = model.forward(chunk, cache, last_only=True)
        for _ in range(new - 1):
            t = time.perf_counter()
            logits = model.forward(logits[:, -1].argmax(-1, keepdim=True), cache, last_only=True)
            decode, steps = decode + time.perf_counter() - t, steps + 1
        # The cue and the label pieces ride on the rows' caches: one more pass of the batch.
        t = time.perf_counter()
        cue = torch.randint(5, cfg.vocab_size, (chunk.shape[0], CUE + LABELS), generator=g)
        torch.log_softmax(model.forward(cue, cache), dim=-1)
        stance += time.perf_counter() - t
    total = time.perf_counter() - started
    return {"seconds": total, "stance_s": stance, "step_s": decode / steps}


def gemm_rate(cfg: YalmConfig, batch: int, dtype: str) -> float:
    """FLOP/s of this layer's largest matmul at ``batch`` rows in ``dtype`` (threads as set), over 0.5 s:
    the product's probe (:func:`robot_llm.llm.plan.rates.gemm_flops`) at this row's shape, not the planner's."""
    return gemm_flops(batch, cfg.hidden_size, 2 * cfg.intermediate_size, dtype, seconds=0.5)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec["threads"])
    store = Store(spec["store"])
    cfg = store.config
    if spec["kind"] == "probe":  # the row's denominators, measured right before it in a process of their own
        # The disk now, over the largest (fp32) layer files (small files measure latency); the better of
        # two passes, so that a neighbour's burst does not flatter our ratios.
        files = store.layer_files()
        size = sum(p.stat().st_size for p in files)
        raw = max(size / sum(p.stat().st_size / measure_read_bandwidth(p, depth=16) for p in files) for _ in "ab")
        return {"raw_bps": raw, "gemm": gemm_rate(cfg, spec["batch"], spec["dtype"])}
    if spec["kind"].startswith("night"):  # a night's real work, passes counted (benchmarks/night.py)
        sys.path.insert(0, str(BENCHMARKS))
        from night import run_night

        files = [store.path / f.name for f in store.manifest.files]
        result = run_night(store.path, spec, Path(spec["vocab"]), cold=lambda: drop_page_cache(files))
        result["peak_rss"] = peak_rss()
        return result
    model: Any
    extra: dict[str, Any] = {}
    opened: Any
    if spec["kind"] == "plan":  # opened the way a night opens it, from cold disk, the opening timed
        settings = night_settings(spec, spec["budget"])
        drop_page_cache([store.path / f.name for f in store.manifest.files])
        started = time.perf_counter()
        opened = Model.open(settings)
        load_s = time.perf_counter() - started
        model = opened.engine
        # The plan the door applied (the same inputs plan the same); checked against the engine it opened.
        used = plan_run(settings, cfg, night_work(settings, cfg), store.manifest)
        assert model.ram_layers == (used.ram_layers if used.weight_home != "disk" else 0), (model.ram_layers, used)
        assert used.batch_size == spec["batch"], (used.batch_size, spec["batch"])  # the parent planned the same
        extra = {
            "load_s": load_s,
            "home": used.weight_home,
            "ram_layers": model.ram_layers,
            "kv_dtype": used.kv_dtype,
            "micro_batch": used.micro_batch,
            "estimate": sum(used.memory["ram"].values()),
        }
    else:
        # Through the door with this row's policy given: these rows run the engine's forward only (the
        # vocabulary is never read). DeepSpeed offloads to NVMe; the stream engine keeps the row's home.
        deepspeed = spec["kind"] == "deepspeed"
        home = "disk" if deepspeed else spec["home"]
        policy = Policy(device="cpu", compute_dtype=spec["dtype"], weight_home=home, threads=spec["threads"])
        settings = ModelSettings(
            vocab=Path(spec.get("vocab", store.path)),
            backend="deepspeed" if deepspeed else "stream",
            store=store.path,
            device="cpu",
            offload="nvme",
            offload_dir=Path(spec["nvme"]) if deepspeed else None,
        )
        opened = Model.open(settings, policy)
        model = opened.engine
        if not deepspeed:
            store = model.store
            if not spec.get("verify", True):  # the A/B row: as if every file were verified already
                store.verified.update(store.entries)
    model.forward(torch.tensor([[5, 6]]))  # untimed warm-up: allocator, kernels, first reads
    if spec.get("verify", True):
        # A night verifies each streamed file on its first pass: that pass belongs in the timed work.
        store.verified.difference_update(f"layer_{i:03d}.safetensors" for i in range(cfg.num_layers))
        store.verify_seconds, store.verified_bytes = 0.0, 0
    drop_page_cache([store.path / f.name for f in store.manifest.files])
    if spec["kind"] == "deepspeed":
        drop_page_cache(model.swap_files())
    result = night(model, cfg, spec["prompts"], spec["prompt"], spec["new"], spec["batch"])
    result["peak_rss"] = peak_rss()
    if "load_s" in extra:  # a night reads its RAM-homed layers before its first token: that time counts
        result["seconds"] += extra["load_s"]
    result |= extra
    if spec["kind"] != "deepspeed":
        result |= {"read_bps": model.stats.read_bandwidth, "io_hidden": model.stats.io_hidden_fraction}
        result |= {"verify_s": store.verify_seconds, "verified_bytes": store.verified_bytes}
    opened.close()
    return result


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in a fresh process (its own peak RSS, its own torch/DeepSpeed state)."""
    log(f"{spec['label']} ...")
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:  # e.g. DeepSpeed's async-I/O op without libaio: this row, not the benchmark
        sys.stderr.write(out.stderr)
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit {out.returncode}"
        log(f"{spec['label']}: could not run: {reason}")
        return {"failed": reason}
    sys.stderr.write(out.stderr)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if "seconds" in result:
        log(
            f"{spec['label']}: {spec['prompts'] * spec['new'] / result['seconds']:.2f} tok/s, {result['seconds']:.1f} s"
        )
    return result


# --------------------------------------------------------------------------- parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, fp32 and int4 only (a few minutes)")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temporary folder, removed afterwards)")
    parser.add_argument("--threads", type=int, help="intra-op threads in every row (default: the free cores)")
    parser.add_argument("--rows", help="comma-separated rows to run, in order (e.g. fp32_b1,int4_b1); no night rows")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over the rows; each row keeps its fastest run (noisy machines)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    size = SIZES["quick" if args.quick else "full"]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="robot-llm-offload-"))
    work.mkdir(parents=True, exist_ok=True)
    threads = args.threads or detect_machine().compute_threads
    try:
        rows = args.rows.split(",") if args.rows else None
        report = benchmark(size, work, threads, NIGHT_BATCH["quick" if args.quick else "full"], rows, args.repeat)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))


def benchmark(
    size: dict[str, Any],
    work: Path,
    threads: int,
    night_batch: int,
    rows: list[str] | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    started = time.perf_counter()
    # 1024 positions: room for the night rows' thesis prompts.
    cfg = YalmConfig(num_layers=size["layers"], max_position_embeddings=1024, vocab_size=4000, **_MID)
    stores = {}
    wanted = size["dtypes"] if rows is None else [d for d in size["dtypes"] if d == "fp32" or f"{d}_" in ",".join(rows)]
    for dtype in wanted:
        stores[dtype] = work / f"store-{dtype}"
        if not (stores[dtype] / "manifest.json").exists():
            log(f"writing the {cfg.num_layers}-layer {dtype} store")
            write_store(stores[dtype], cfg, random_modules(cfg), dtype=dtype)
    P, N = size["prompt"], size["new"]
    ram = detect_machine().ram_bytes
    base = {"prompt": P, "new": N, "threads": threads}
    specs: dict[str, dict[str, Any]] = {}
    for dtype in wanted:
        for b in size["batches"]:
            specs[f"{dtype}_b{b}"] = base | {
                "label": f"engine {dtype} store, disk, batch {b}",
                "kind": "engine",
                "home": "disk",
                "store": str(stores[dtype]),
                "dtype": compute_dtype(dtype),
                "batch": b,
                "prompts": b,
            }
    # The same cold-disk rows without checksum verification: what verifying the first pass costs (A/B).
    for b in size["batches"]:
        if f"fp32_b{b}" in specs:
            specs[f"fp32_b{b}_noverify"] = specs[f"fp32_b{b}"] | {
                "label": f"engine fp32 store, disk, batch {b}, unverified",
                "verify": False,
            }
    # The same model held in RAM by our engine: the bound a cold-disk row is measured against, per dtype.
    for dtype in (d for d in ("fp32", "bf16", "int4") if f"{d}_b32" in specs):
        held = {"label": f"engine {dtype} held in RAM, batch 32", "home": "ram"}
        specs[f"{dtype}_ram_b32"] = specs[f"{dtype}_b32"] | held
    # Opened the way a night opens it (Model.open: the plan applied within a RAM budget), from cold
    # disk, the opening inside the timed work: within a budget that holds about half the layers, and within
    # this machine's RAM.
    for dtype in (d for d in ("fp32", "bf16") if f"{d}_b32" in specs):
        wanted_plan = [k for k in (f"{dtype}_plan_half_b32", f"{dtype}_plan_b32") if rows is None or k in rows]
        if not wanted_plan:
            continue
        as_night = {k: v for k, v in specs[f"{dtype}_b32"].items() if k != "home"}  # the plan chooses the home
        as_night |= {"kind": "plan", "vocab": str(_vocabulary(work))}
        half = half_layers_budget(as_night)
        budgets = {
            f"{dtype}_plan_half_b32": ("about half the layers in RAM", half),
            f"{dtype}_plan_b32": ("this machine's RAM", ram),
        }
        for key in wanted_plan:
            what, budget = budgets[key]
            row = as_night | {"budget": budget, "budget_is": what, "max_batch": 32}
            # The night's batches are the plan's (its 32 prompts in batches of the planned size), as a night's are.
            store = Store(row["store"])
            settings = night_settings(row, budget)
            planned = plan_run(settings, store.config, night_work(settings, store.config), store.manifest)
            label = f"engine {dtype} planned in {budget / 2**30:.2f} GiB, batch {planned.batch_size}"
            specs[key] = row | {"label": label, "batch": planned.batch_size}
    for dtype in ("fp32", "bf16") if "bf16" in stores else ("fp32",):
        for b in size["batches"]:
            specs[f"ds_{dtype}_b{b}"] = base | {
                "label": f"DeepSpeed ZeRO-3 NVMe {dtype}, batch {b}",
                "kind": "deepspeed",
                "store": str(stores[dtype]),
                "dtype": dtype,
                "batch": b,
                "prompts": b,
                "nvme": str(work / "nvme"),
            }
    if rows is not None:
        unknown = [r for r in rows if r not in specs]
        if unknown:
            plans = [f"{d}_plan{h}_b32" for d in ("fp32", "bf16") if f"{d}_b32" in specs for h in ("_half", "")]
            known = [*specs, *(k for k in plans if k not in specs)]
            raise SystemExit(f"unknown rows {', '.join(unknown)}; choose from {', '.join(known)}")
        specs = {r: specs[r] for r in rows}
    # Rounds over every row, each run a fresh process with its own probe: a row keeps its fastest run (a
    # neighbour's burst only ever slows a run down), the spread (slowest / fastest) and its highest peak RSS.
    tries: dict[str, list[dict[str, Any]]] = {key: [] for key in specs}
    for round_ in range(repeat):
        for key, spec in specs.items():
            label = spec["label"] + (f" (round {round_ + 1} of {repeat})" if repeat > 1 else "")
            probe = run_child(spec | {"kind": "probe", "store": str(stores["fp32"]), "label": f"{label}: probe"})
            tries[key].append(probe if "failed" in probe else run_child(spec | {"label": label}) | probe)
    runs = {}
    failed: dict[str, str] = {}
    for key, all_results in tries.items():
        results = [r for r in all_results if "failed" not in r]
        if not results:
            failed[key] = all_results[0]["failed"]
            continue
        runs[key] = min(results, key=lambda r: r["seconds"]) | {
            "spread": max(r["seconds"] for r in results) / min(r["seconds"] for r in results),
            "peak_rss": max(r["peak_rss"] for r in results),
        }
    shutil.rmtree(work / "nvme", ignore_errors=True)
    specs = {k: v for k, v in specs.items() if k in runs}
    if rows is not None:
        result = report(cfg, specs, runs, threads, failed)
        print(f"total benchmark time {time.perf_counter() - started:.0f} s")
        return result
    nights = {}
    for kind, label in (("night-rescore", "stance re-prefilled (before)"), ("night", "stance from the cache (now)")):
        shape = {"prompt": 0, "new": N, "batch": night_batch, "prompts": 2 * night_batch, "threads": threads}
        spec = shape | {"label": f"night, {label}", "kind": kind, "store": str(stores["fp32"])}
        # --repeat rounds like every other row: the fastest run is kept, the spread shown.
        spec |= {"vocab": str(_vocabulary(work))}
        rounds = []
        for i in range(repeat):
            round_label = spec["label"] + (f" (round {i + 1} of {repeat})" if repeat > 1 else "")
            rounds.append(run_child(spec | {"label": round_label}))
        nights[label] = min(rounds, key=lambda r: r["seconds"]) | {
            "spread": max(r["seconds"] for r in rounds) / min(r["seconds"] for r in rounds)
        }
    result = report(cfg, specs, runs, threads, failed)
    for label, r in nights.items():
        if "failed" in r:
            print(f"night, {label}: could not run: {r['failed']}")
            continue
        print(
            f"night, {label}: {r['theses']} theses in {r['batches']} batches, {r['generation_passes']} generation + "
            f"{r['stance_passes']} stance weight passes ({r['passes_per_thesis']:.2f} per thesis, "
            f"{r['stance_passes_per_batch']:.2f} stance per batch), "
            f"{r['bytes_streamed_per_thesis'] / 2**20:.0f} MiB streamed per thesis, {r['seconds']:.1f} s"
            f" (spread {r['spread']:.2f}x over {repeat} runs)"
        )
    now, before = nights["stance from the cache (now)"], nights["stance re-prefilled (before)"]
    if "failed" in now or "failed" in before:
        print(f"total benchmark time {time.perf_counter() - started:.0f} s")
        return result
    result |= {
        "passes_per_thesis": round(now["passes_per_thesis"], 3),
        "stance_passes_per_batch": round(now["stance_passes_per_batch"], 3),
        "bytes_streamed_per_thesis": int(now["bytes_streamed_per_thesis"]),
        "passes_per_thesis_rescore": round(before["passes_per_thesis"], 3),
        "stance_passes_per_batch_rescore": round(before["stance_passes_per_batch"], 3),
    }
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    return result


def _vocabulary(work: Path) -> Path:
    sys.path.insert(0, str(BENCHMARKS))
    from night import vocabulary

    return Path(vocabulary(work))


def hash_rate() -> float:
    """Bytes/s of the store checksum (XXH3-64) on one core of this CPU, best of three over 256 MiB."""
    import os

    import xxhash

    data = os.urandom(256 << 20)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        xxhash.xxh3_64_hexdigest(data)
        best = min(best, time.perf_counter() - started)
    return len(data) / best


def cpu_line() -> str:
    """The CPU's vector features and the load average (timings on a shared machine need both)."""
    import os

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "sha_ni")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"cpu: {os.cpu_count()} cores, {' '.join(f for f in wanted if f in flags) or 'no AVX2'}; load average {load}"


def report(
    cfg: YalmConfig,
    specs: dict[str, dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    threads: int,
    failed: dict[str, str] | None = None,
) -> dict:
    L, params = cfg.num_layers, layer_params(cfg)
    ram = detect_machine().ram_bytes
    print(cpu_line())
    print(
        f"model: {L} layers, hidden {cfg.hidden_size}, {params / 1e6:.1f} M parameters per layer; "
        f"{threads} intra-op thread(s) in every row; the stance of every row scored inside the timed work"
    )
    print(
        f"{'configuration':<42} {'weights':>10} {'tok/s':>7} {'spread':>6} {'load s':>6} {'stance':>7} {'step s':>7} "
        f"{'roofline':>8} {'raw GB/s':>8} {'read GB/s':>9} {'RSS MiB':>8} {'plan MiB':>8}"
    )
    ratios: dict[str, float] = {}
    for key, spec in specs.items():
        r = runs[key]
        tok_s = spec["prompts"] * spec["new"] / r["seconds"]
        r["tok_s"] = tok_s
        weight_dtype = Store(spec["store"]).manifest.dtype
        planned_row = spec["kind"] == "plan"
        # Layers in RAM: as the plan chose (plan rows), all (held in RAM), none (cold disk; DeepSpeed streams all).
        in_ram = r["ram_layers"] if planned_row else L if spec.get("home") == "ram" else 0
        step_bytes = (L - in_ram) * layer_bytes(cfg, weight_dtype)
        r["roofline_s"] = max(step_bytes / r["raw_bps"], 2 * spec["batch"] * params * L / r["gemm"])
        if spec["kind"] == "engine":  # the planner models our engine, not DeepSpeed's buffers
            est = plan(
                cfg,
                Work(spec["batch"], spec["prompt"], spec["new"] + CUE + LABELS),
                Machine(ram_bytes=ram),
                weight_dtype=weight_dtype,
                compute_dtype=spec["dtype"],
                weight_home=spec["home"],
                max_batch_size=spec["batch"],
                headroom=1.0,
            )
            r["estimate"] = sum(est.memory["ram"].values())
        elif not planned_row:  # plan rows: the RAM total of the plan the door applied (the child's)
            r["estimate"] = None
        home = "ram" if in_ram == L else f"split {in_ram}/{L}" if in_ram else "disk"
        read = f"{r['read_bps'] / 1e9:9.2f}" if "read_bps" in r else f"{'-':>9}"
        planned = f"{r['estimate'] / 2**20:8.0f}" if r["estimate"] else f"{'-':>8}"
        load = f"{r['load_s']:6.1f}" if planned_row else f"{'-':>6}"
        print(
            f"{spec['label']:<42} {home:>10} {tok_s:7.2f} {r['spread']:6.2f} {load} {r['stance_s']:6.1f}s "
            f"{r['step_s']:7.3f} "
            f"{r['roofline_s']:8.3f} {r['raw_bps'] / 1e9:8.2f} {read} {r['peak_rss'] / 2**20:8.0f} {planned}"
        )
    for key, spec in specs.items():
        if spec["kind"] == "plan":
            r = runs[key]
            print(
                f"{key}: budget = {spec['budget_is']} ({spec['budget'] / 2**20:.0f} MiB); the plan: weights in "
                f"{r['home']} ({r['ram_layers']} of {L} layers in RAM), batch {spec['batch']} of at most 32, KV "
                f"cache {r['kv_dtype']}, prefill micro-batch {r['micro_batch']}; opened from cold disk in "
                f"{r['load_s']:.2f} s, inside its tok/s"
            )

    def ratio(name: str, ours: str, theirs: str) -> None:
        if ours in runs and theirs in runs:
            ratios[name] = round(runs[ours]["tok_s"] / runs[theirs]["tok_s"], 2)

    ratio("fp32_b32_vs_deepspeed_fp32_b32", "fp32_b32", "ds_fp32_b32")
    ratio("bf16_b32_vs_deepspeed_bf16_b32", "bf16_b32", "ds_bf16_b32")
    ratio("fp32_b1_vs_deepspeed_fp32_b1", "fp32_b1", "ds_fp32_b1")
    ratio("bf16_b1_vs_deepspeed_bf16_b1", "bf16_b1", "ds_bf16_b1")
    for dtype in ("fp32", "bf16", "int4"):
        ratio(f"{dtype}_disk_b32_vs_ram_b32", f"{dtype}_b32", f"{dtype}_ram_b32")
    # The plan applied, its cold load counted (the forced-disk ratios above stream every pass).
    for dtype in ("fp32", "bf16"):
        for row in (f"{dtype}_plan_b32", f"{dtype}_plan_half_b32"):
            ratio(f"{row}_vs_deepspeed_{dtype}_b32", row, f"ds_{dtype}_b32")
            ratio(f"{row}_vs_ram_b32", row, f"{dtype}_ram_b32")
    ratio("int4_b1_vs_fp32_b1", "int4_b1", "fp32_b1")
    ratio("int8_b1_vs_fp32_b1", "int8_b1", "fp32_b1")
    ratio("int4_b32_vs_fp32_b32", "int4_b32", "fp32_b32")
    steps = {k: round(runs[k]["step_s"] / runs[k]["roofline_s"], 2) for k in runs if not k.startswith("ds_")}
    rss = {k: round(r["peak_rss"] / r["estimate"], 2) for k, r in runs.items() if r["estimate"]}
    for key, reason in (failed or {}).items():
        print(f"{key}: could not run: {reason}")
    verification = _verification(runs)
    print("headline ratios (fresh processes only): " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    print("decode step / roofline: " + ", ".join(f"{k} {v}x" for k, v in steps.items()))
    print("peak RSS / planner estimate: " + ", ".join(f"{k} {v}x" for k, v in rss.items()))
    spread = {k: round(r["spread"], 2) for k, r in runs.items()}
    return {
        "ratios": ratios,
        "step_vs_roofline": steps,
        "rss_vs_estimate": rss,
        "spread": spread,
        "threads": threads,
        "verification": verification,
        "failed_rows": failed or {},
    }


def _verification(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What checksumming the first pass costs: its hashing time over the row's time, and the A/B ratio."""
    rate = hash_rate()
    out: dict[str, float] = {"hash_gbps": round(rate / 1e9, 2)}
    parts = []
    for key in sorted(k for k in runs if k.endswith("_noverify")):
        verified, plain = runs.get(key.removesuffix("_noverify")), runs[key]
        if verified is None:
            continue
        share = verified["verify_s"] / verified["seconds"]
        slowdown = verified["seconds"] / plain["seconds"] - 1
        out[f"{key.removesuffix('_noverify')}_hash_share"] = round(share, 4)
        out[f"{key.removesuffix('_noverify')}_vs_unverified"] = round(slowdown, 4)
        parts.append(
            f"{key.removesuffix('_noverify')}: {verified['verified_bytes'] / 2**20:.0f} MiB hashed in "
            f"{verified['verify_s']:.3f} s = {100 * share:.2f}% of its {verified['seconds']:.1f} s "
            f"(on the reader thread, beside compute); {100 * slowdown:+.1f}% against the unverified row"
        )
    print(
        f"checksums (xxh3-64, each file once, on the first pass): {rate / 1e9:.2f} GB/s on one core here; "
        + "; ".join(parts)
    )
    return out


if __name__ == "__main__":
    main()
