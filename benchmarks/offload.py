"""Offload benchmark: naive per-token streaming vs the batched streaming engine vs DeepSpeed ZeRO-Inference.

A mid-size YaLM config with random fp32 weights is written to a store on disk.
Every measured configuration then runs in its own child process (so peak RSS
is its own) on the same work (prompts of ``prompt`` tokens, ``new`` generated
tokens each, greedy), with the store's page cache dropped first so that "disk"
means disk:

* naive: one prompt at a time, every layer read synchronously for every token
  (the original ZeRO-Offload / AirLLM schedule);
* engine at batch 1, 8 and 32: each layer read once per step for the whole
  batch, the next layer prefetched while the current one computes;
* DeepSpeed ZeRO-3 with NVMe parameter offload at batch 32 (fp32 on CPU, so it
  reads the same bytes per step as our fp32 store);
* DeepSpeed at batch 8 as well, where a 2-core CPU is I/O-bound rather than compute-bound;
* (full size only) the engine from an fp16 store, half the bytes per step: the release's own
  dtype, which DeepSpeed cannot use on a CPU;
* the engine under a RAM budget of a quarter of a (larger) store, planned by
  :mod:`robot_llm.llm.planner`.

It also measures the raw sequential read bandwidth of the same layer files.
The last line printed is one JSON object with the headline figures.

    python benchmarks/offload.py [--quick] [--dir WORK_DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from robot_llm.llm.checkpoint import ModuleKind, module_plan
from robot_llm.llm.config import YalmConfig
from robot_llm.llm.family import Params
from robot_llm.llm.machine import Machine, detect_machine
from robot_llm.llm.planner import Work, plan
from robot_llm.llm.store import Store, drop_page_cache, measure_read_bandwidth, write_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from night import run_night, vocabulary  # the benchmarks folder is no package

SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "config": YalmConfig(
            num_layers=12,
            hidden_size=1024,
            embedding_size=256,
            intermediate_size=2730,
            num_attention_heads=16,
            max_position_embeddings=1024,  # room for the night's thesis prompts
            vocab_size=4000,
        ),
        "prompt": 8,
        "new": 32,
        "naive_prompts": 2,
        "budget_layers": 48,
        "budget_new": 4,
        "night_batch": 8,
        "fp16_rows": True,
    },
    "quick": {
        "config": YalmConfig(
            num_layers=4,
            hidden_size=1024,
            embedding_size=256,
            intermediate_size=2730,
            num_attention_heads=16,
            max_position_embeddings=1024,  # room for the night's thesis prompts
            vocab_size=4000,
        ),
        "prompt": 4,
        "new": 12,
        "naive_prompts": 1,
        "budget_layers": 36,
        "budget_new": 2,
        "night_batch": 4,
        "fp16_rows": False,
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_modules(cfg: YalmConfig, distinct_layers: int | None = None) -> Iterator[tuple[ModuleKind, int, Params]]:
    """Random release-shaped modules one at a time (never the whole model in memory).

    With ``distinct_layers`` only that many layers are drawn and later layers repeat
    the last of them (same bytes, separate files): a large store written quickly.
    """
    drawn: dict[int, Params] = {}
    g = torch.Generator().manual_seed(0)
    for kind, index, _, shapes in module_plan(cfg):
        source = index if distinct_layers is None or kind != "layer" else min(index, distinct_layers - 1)
        if kind == "layer" and source in drawn:
            yield kind, index, drawn[source]
            continue
        params = {}
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=g)
            if len(shape) == 2:
                t *= 0.02
            elif name.endswith("norm.weight"):
                t = 1.0 + 0.1 * t
            else:
                t *= 0.1
            params[name] = t
        if kind == "layer" and distinct_layers is not None:
            drawn[source] = params
        yield kind, index, params


def run_batches(model: Any, ids: torch.Tensor, new: int, batch: int) -> None:
    """Greedy generation of ``new`` tokens for every row, ``batch`` rows at a time."""
    for start in range(0, ids.shape[0], batch):
        chunk = ids[start : start + batch]
        cache = model.new_cache(chunk.shape[0], chunk.shape[1] + new - 1)
        logits = model.forward(chunk, cache, last_only=True)
        for _ in range(new - 1):
            logits = model.forward(logits[:, -1].argmax(-1, keepdim=True), cache, last_only=True)


def child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured configurations run one after the other in this process (ordered by growing memory,
    so the peak RSS reported after each run is that run's own peak)."""
    store = Store(spec["store"])
    cfg = store.config
    results = []
    for run in spec["runs"]:
        log(f"{run['label']}: {run['prompts']} prompts x {run['new']} tokens, batch {run['batch']} ...")
        if run["kind"].startswith("night"):
            drop_page_cache([store.path / f.name for f in store.manifest.files])
            night = run_night(store.path, run, Path(run["vocab"]))
            night["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            night["tok_s"] = run["prompts"] * run["new"] / night["seconds"]
            log(
                f"{run['label']}: {night['passes_per_thesis']:.2f} passes per thesis, "
                f"{night['stance_passes_per_batch']:.2f} stance passes per batch, {night['seconds']:.1f} s"
            )
            results.append(night)
            continue
        ids = torch.randint(
            5, cfg.vocab_size, (run["prompts"], run["prompt"]), generator=torch.Generator().manual_seed(1)
        )
        if run["kind"] == "deepspeed":
            from robot_llm.llm.backends.deepspeed import DeepSpeedModel

            model: Any = DeepSpeedModel(store.path, cfg, offload="nvme", dtype="fp32", offload_dir=run["nvme"])
        else:
            from robot_llm.llm.engine import StreamingModel

            model = StreamingModel(
                store, home="disk", device="cpu", prefetch=run["kind"] != "naive", micro_batch=run.get("micro")
            )
        raw_bps = raw_read_bandwidth(store.layer_files())
        drop_page_cache([store.path / f.name for f in store.manifest.files])
        started = time.perf_counter()
        run_batches(model, ids, run["new"], run["batch"])
        elapsed = time.perf_counter() - started
        result: dict[str, Any] = {
            "tok_s": run["prompts"] * run["new"] / elapsed,
            "seconds": elapsed,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "raw_bps": raw_bps,
        }
        if run["kind"] == "deepspeed":
            result["swap_bytes"] = sum(p.stat().st_size for p in model.swap_files())
            model.close()
        else:
            model.close()
            s = model.stats
            result |= {"read_bps": s.read_bandwidth, "io_hidden": s.io_hidden_fraction}
        log(
            f"{run['label']}: {result['tok_s']:.2f} tok/s in {elapsed:.1f} s, "
            f"peak RSS {result['peak_rss'] / 2**20:.0f} MiB"
        )
        results.append(result)
    return results


def raw_read_bandwidth(files: list[Path]) -> float:
    """Sequential O_DIRECT read bandwidth over these files, measured now (the disk is shared and varies)."""
    total = sum(p.stat().st_size for p in files)
    return total / sum(p.stat().st_size / measure_read_bandwidth(p) for p in files)


def run_child(store: Path, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``runs`` in a fresh process (its own peak RSS, its own DeepSpeed state)."""
    spec = {"store": str(store), "runs": runs}
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmark child failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and work (< 3 minutes)")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temporary folder, removed afterwards)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    size = SIZES["quick" if args.quick else "full"]
    cfg: YalmConfig = size["config"]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="robot-llm-offload-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        report = benchmark(cfg, size, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))


def benchmark(cfg: YalmConfig, size: dict[str, Any], work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    main_store = work / "store"
    if not (main_store / "manifest.json").exists():
        log(f"writing a {cfg.num_layers}-layer fp32 store with random weights to {main_store}")
        write_store(main_store, cfg, random_modules(cfg), dtype="fp32")
    store = Store(main_store)
    layer_files = store.layer_files()
    store_bytes = store.manifest.total_bytes

    raw_bytes = sum(p.stat().st_size for p in layer_files)
    raw_bps = raw_read_bandwidth(layer_files)
    log(f"raw sequential read of the layer files: {raw_bps / 1e6:.0f} MB/s")

    P, N = size["prompt"], size["new"]
    work_shape = {"prompt": P, "new": N}
    engine_runs = [
        work_shape
        | {"label": "naive (batch 1, no prefetch)", "kind": "naive", "batch": 1, "prompts": size["naive_prompts"]}
    ]
    engine_runs += [
        work_shape
        | {
            "label": f"engine batch {b}",
            "kind": "engine",
            "batch": b,
            "prompts": size["naive_prompts"] if b == 1 else b,
        }
        for b in (1, 8, 32)
    ]
    runs = dict(zip(["naive", "b1", "b8", "b32"], run_child(main_store, engine_runs), strict=True))
    # DeepSpeed at batch 8 too: there this CPU is I/O-bound, so the comparison shows scheduling, not FLOPs.
    ds_runs = [
        work_shape
        | {"label": f"DeepSpeed ZeRO-3 NVMe batch {b}", "kind": "deepspeed", "batch": b, "prompts": b}
        | {"nvme": str(work / "nvme")}
        for b in (8, 32)
    ]
    # The same engine runs again in the DeepSpeed process: torch code measurably runs faster in a
    # process where DeepSpeed has run (cause not found), so only same-process pairs compare fairly.
    ds_runs += [
        work_shape | {"label": f"engine batch {b}, after DeepSpeed", "kind": "engine", "batch": b, "prompts": b}
        for b in (8, 32)
    ]
    runs["deepspeed_b8"], runs["deepspeed"], runs["ds_proc_b8"], runs["ds_proc_b32"] = run_child(main_store, ds_runs)
    shutil.rmtree(work / "nvme", ignore_errors=True)

    if size["fp16_rows"]:
        # Our default store keeps the release's fp16 (half the bytes); DeepSpeed cannot run fp16 on a CPU.
        half_store = work / "store-fp16"
        if not (half_store / "manifest.json").exists():
            write_store(half_store, cfg, random_modules(cfg), dtype="fp16")
        half_runs = [
            work_shape | {"label": f"engine batch {b}, fp16 store", "kind": "engine", "batch": b, "prompts": b}
            for b in (8, 32)
        ]
        runs["fp16_b8"], runs["fp16_b32"] = run_child(half_store, half_runs)

    machine = detect_machine(raw_bps)
    estimate = plan(
        cfg, Work(32, P, N), machine, weight_dtype="fp32", compute_dtype="fp32", weight_home="disk", max_batch_size=32
    )
    estimated_rss = sum(estimate.memory["ram"].values())

    # Budget run: a store four times the RAM budget, batch and micro-batch from the planner.
    big_cfg = YalmConfig(**(cfg.to_dict() | {"num_layers": size["budget_layers"]}))
    big_store = work / "big-store"
    if not (big_store / "manifest.json").exists():
        log(f"writing a {big_cfg.num_layers}-layer store for the budget run")
        write_store(big_store, big_cfg, random_modules(big_cfg, distinct_layers=2), dtype="fp32")
    big_bytes = Store(big_store).manifest.total_bytes
    budget = big_bytes // 4
    budget_plan = plan(
        big_cfg,
        Work(32, P, size["budget_new"]),
        Machine(ram_bytes=machine.ram_bytes, disk_read_bps=raw_bps),
        weight_dtype="fp32",
        compute_dtype="fp32",
        weight_home="disk",
        memory_budget_bytes=budget,
        headroom=1.0,
    )
    budget_run = {
        "label": f"engine under a {budget / 2**20:.0f} MiB budget (store {big_bytes / 2**20:.0f} MiB)",
        "kind": "engine",
        "prompt": P,
        "new": size["budget_new"],
        "batch": budget_plan.batch_size,
        "micro": budget_plan.micro_batch,
        "prompts": 32,
    }
    runs["budget"] = run_child(big_store, [budget_run])[0]

    # A night's work, generation plus stance: as the worker did it before, and as it does it now.
    night_shape = {"prompt": 0, "new": N, "batch": size["night_batch"], "prompts": 2 * size["night_batch"]}
    night_runs = [
        night_shape | {"label": f"night, {label}", "kind": kind, "vocab": str(vocabulary(work))}
        for kind, label in (("night-rescore", "stance re-prefilled"), ("night", "stance from the KV cache"))
    ]
    runs["night_rescore"], runs["night"] = run_child(main_store, night_runs)

    b32 = runs["b32"]
    result = {
        "naive_tok_s": round(runs["naive"]["tok_s"], 3),
        "engine_tok_s": {str(b): round(runs[f"b{b}"]["tok_s"], 3) for b in (1, 8, 32)},
        "deepspeed_tok_s": round(runs["deepspeed"]["tok_s"], 3),
        "speedup_vs_naive": round(b32["tok_s"] / runs["naive"]["tok_s"], 2),
        "speedup_vs_deepspeed": round(runs["ds_proc_b32"]["tok_s"] / runs["deepspeed"]["tok_s"], 2),
        "stream_read_fraction": round(b32["read_bps"] / b32["raw_bps"], 3),
        "io_hidden_fraction": round(b32["io_hidden"], 3),
        "peak_rss_vs_estimate": round(b32["peak_rss"] / estimated_rss, 3),
        "peak_rss_vs_budget": round(runs["budget"]["peak_rss"] / budget, 3),
        "passes_per_thesis": round(runs["night"]["passes_per_thesis"], 3),
        "stance_passes_per_batch": round(runs["night"]["stance_passes_per_batch"], 3),
        "bytes_streamed_per_thesis": int(runs["night"]["bytes_streamed_per_thesis"]),
        "passes_per_thesis_rescore": round(runs["night_rescore"]["passes_per_thesis"], 3),
        "stance_passes_per_batch_rescore": round(runs["night_rescore"]["stance_passes_per_batch"], 3),
    }
    print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, fp32 store {store_bytes / 2**20:.0f} MiB "
        f"({raw_bytes / cfg.num_layers / 2**20:.0f} MiB per layer); work: prompts of {P} tokens, {N} new tokens each"
    )
    print(
        f"raw sequential read bandwidth (O_DIRECT): {raw_bps / 1e6:.0f} MB/s at the start, "
        f"{b32['raw_bps'] / 1e6:.0f} MB/s right before the batch-32 run"
    )
    print(f"{'configuration':<40} {'tok/s':>8} {'seconds':>8} {'peak RSS':>9} {'read MB/s':>9} {'I/O hidden':>10}")
    for key, label in [
        ("naive", "naive: batch 1, no prefetch"),
        ("b1", "engine batch 1"),
        ("b8", "engine batch 8"),
        ("b32", "engine batch 32"),
        ("deepspeed_b8", "DeepSpeed ZeRO-3 NVMe, batch 8"),
        ("deepspeed", "DeepSpeed ZeRO-3 NVMe, batch 32"),
        ("ds_proc_b8", "engine batch 8, in the DeepSpeed process"),
        ("ds_proc_b32", "engine batch 32, in the DeepSpeed process"),
        *(
            [("fp16_b8", "engine batch 8, fp16 store"), ("fp16_b32", "engine batch 32, fp16 store")]
            if "fp16_b8" in runs
            else []
        ),
        ("budget", f"engine, budget {budget / 2**20:.0f} MiB, batch {budget_plan.batch_size}"),
    ]:
        r = runs[key]
        read = f"{r['read_bps'] / 1e6:9.0f}" if "read_bps" in r else f"{'-':>9}"
        hidden = f"{100 * r['io_hidden']:9.0f}%" if "io_hidden" in r else f"{'-':>10}"
        print(f"{label:<40} {r['tok_s']:8.2f} {r['seconds']:8.1f} {r['peak_rss'] / 2**20:8.0f}M {read} {hidden}")
    print(f"DeepSpeed wrote {runs['deepspeed']['swap_bytes'] / 2**20:.0f} MiB of NVMe swap files")
    print(f"engine batch 32 / naive: {result['speedup_vs_naive']}x")

    def ratio(ours: str, theirs: str) -> str:
        return f"{runs[ours]['tok_s'] / runs[theirs]['tok_s']:.2f}x"

    print(
        f"engine / DeepSpeed, same process: batch 8 {ratio('ds_proc_b8', 'deepspeed_b8')}, "
        f"batch 32 {ratio('ds_proc_b32', 'deepspeed')}; separate processes: batch 8 "
        f"{ratio('b8', 'deepspeed_b8')}, batch 32 {ratio('b32', 'deepspeed')}"
    )
    if "fp16_b8" in runs:
        print(
            f"fp16 store / DeepSpeed (fp32): batch 8 {runs['fp16_b8']['tok_s'] / runs['deepspeed_b8']['tok_s']:.2f}x, "
            f"batch 32 {runs['fp16_b32']['tok_s'] / runs['deepspeed']['tok_s']:.2f}x"
        )
    print(
        f"streaming read bandwidth / raw: {result['stream_read_fraction']:.0%}; "
        f"I/O hidden behind compute: {result['io_hidden_fraction']:.0%}"
    )
    print(
        f"peak RSS batch 32: {b32['peak_rss'] / 2**20:.0f} MiB vs planner estimate {estimated_rss / 2**20:.0f} MiB "
        f"({result['peak_rss_vs_estimate']:.2f}x)"
    )
    print(
        f"peak RSS under budget: {runs['budget']['peak_rss'] / 2**20:.0f} MiB vs budget {budget / 2**20:.0f} MiB "
        f"({result['peak_rss_vs_budget']:.2f}x) with a store of {big_bytes / 2**20:.0f} MiB"
    )
    for key, label in (("night_rescore", "stance re-prefilled (before)"), ("night", "stance from the cache (now)")):
        r = runs[key]
        print(
            f"night, {label}: {r['theses']} theses in {r['batches']} batches, {r['generation_passes']} generation + "
            f"{r['stance_passes']} stance weight passes ({r['passes_per_thesis']:.2f} per thesis, "
            f"{r['stance_passes_per_batch']:.2f} stance per batch), "
            f"{r['bytes_streamed_per_thesis'] / 2**20:.0f} MiB streamed per thesis, {r['seconds']:.1f} s"
        )
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")
    return result


if __name__ == "__main__":
    main()
