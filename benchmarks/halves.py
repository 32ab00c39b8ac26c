"""A batch's decode step as one batch, or as two half-batches that run side by side on half the threads each.

Why this exists: the roofline of ``llamacpp.py`` takes the larger of a step's bytes and its FLOPs, as if the
attention's reads of the KV cache overlapped the products' arithmetic. Within one batch they cannot: a layer's
attention needs its own products' queries, keys and values, the products after it need its output, and the output
head needs every layer. Two halves of the batch, each stepping on its own, could overlap them (one half's attention
beside the other's products), at the price of reading every weight, the 168 MB head too, once for each half. This
script measures whether that pays.

Configurations, each in a fresh process after an untimed warm-up, interleaved over ``--rounds``:

* ``one``: ``B`` rows stepped together at ``T`` threads (the engine as it runs a night);
* ``halves``: two ``B / 2``-row batches, each with its own engine and cache, stepped by its own Python thread at
  ``T / 2`` kernel threads, free-running (each half takes its next step as soon as its last is done, so their phases
  drift apart);
* ``locked``: the same two halves, both waiting for the slower one at every step (what the generation loop, which
  chooses every row's token together, would run).

Each process prefills its rows (``--prompt`` tokens, untimed) and decodes ``--new`` greedy steps; printed: ms per
step for all ``B`` rows, the ratio to ``one`` in the same round, and which configurations chose tokens other than
the whole batch's. The CPU's features head the table; the last line is one JSON object.

    python benchmarks/halves.py [--threads 2] [--batch 32] [--prompt 512] [--new 64] [--rounds 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llamacpp

CONFIGS = ("one", "halves", "locked")


@dataclass
class Rows:
    """Rows stepped together: their engine, cache, last tokens and every token chosen since the prefill."""

    model: Any
    cache: Any
    token: Any
    chosen: list[Any] = field(default_factory=list)

    def step(self, n: int) -> None:
        from robot_llm.llm.sampling import greedy_tokens

        for _ in range(n):
            self.token = greedy_tokens(self.model.forward(self.token, self.cache, last_only=True)[:, -1])[:, None]
            self.chosen.append(self.token)


def prefilled(model: Any, ids: Any, new: int) -> Rows:
    """``ids``' rows prefilled on ``model``, with room for ``new`` steps."""
    from robot_llm.llm.sampling import greedy_tokens

    cache = model.new_cache(ids.shape[0], ids.shape[1] + new + 4)
    return Rows(model, cache, greedy_tokens(model.forward(ids, cache, last_only=True)[:, -1])[:, None])


def child(store: Path, config: str, threads: int, batch: int, prompt: int, new: int) -> dict[str, Any]:
    """One configuration's measurement inside its fresh process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    parts = [range(batch)] if config == "one" else [range(batch // 2), range(batch // 2, batch)]
    # An engine for each half: one engine's layers stream through one set of slots, for one step at a time (two
    # halves stepping one engine at once took each other's layers now and then, and chose other tokens).
    engines = [llamacpp.open_ours(store, threads, micro_batch=4) for _ in parts]
    opened, dtype = [e[0] for e in engines], engines[0][1]
    ids = torch.randint(
        100, opened[0].engine.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)
    )
    # The whole batch steps in this thread, as a night's does, with no other thread that has run a parallel region:
    # libgomp's idle threads spin only while it manages no more threads than there are CPUs, and otherwise sleep
    # between regions, to be woken at every one (a pool thread's team beside this one's made the step 52-70 ms
    # where alone it took 45).
    pool = None
    if config != "one":
        pool = ThreadPoolExecutor(len(parts), initializer=torch.set_num_threads, initargs=(threads // 2,))

    def each(fn: Any, items: list[Any]) -> list[Any]:
        return [fn(item) for item in items] if pool is None else list(pool.map(fn, items))

    # untimed: first calls, allocator, kernel dispatch, pool threads
    each(lambda o: prefilled(o.engine, ids[:2, :16], 2).step(2), opened)
    rows = each(
        lambda half: prefilled(half[0].engine, ids[half[1].start : half[1].stop], new),
        list(zip(opened, parts, strict=True)),
    )
    started = time.perf_counter()
    if config == "locked":
        for _ in range(new):
            each(lambda r: r.step(1), rows)
    else:
        each(lambda r: r.step(new), rows)
    seconds = time.perf_counter() - started
    tokens = torch.cat([torch.cat(r.chosen, dim=1) for r in rows]).tolist()
    for o in opened:
        o.close()
    return {"config": config, "step_s": seconds / new, "tokens": tokens, "peak_rss": llamacpp.vm_hwm(), "dtype": dtype}


def run(store: Path, config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in a fresh process (this script as its own child)."""
    cmd = [sys.executable, __file__, "--child", str(store), "--config", config, "--threads", str(args.threads)]
    cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{config} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads of the whole batch (each half gets half)")
    parser.add_argument("--batch", type=int, default=32, help="rows of the whole batch (even)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the configurations, interleaved")
    parser.add_argument("--cache", type=Path, default=llamacpp.DEFAULT_CACHE, help="llamacpp.py's store cache")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, default="one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.config, args.threads, args.batch, args.prompt, args.new)))
        return
    if args.batch % 2 or args.batch < 2 or args.threads % 2 or args.threads < 2:
        parser.error("--batch and --threads must be even (each half takes half of both)")
    store = llamacpp.store_for(llamacpp.demo_gguf(), args.cache)
    features = llamacpp.cpu_features()
    print(
        f"CPU: {features['cpu']}, {features['cores']} cores; AVX2 {features['avx2']}, AVX512 {features['avx512f']}, "
        f"AVX512-BF16 {features['avx512_bf16']}, AMX {features['amx']}; torch kernels: {features['aten']}; "
        f"{args.batch} rows, {args.threads} threads (halves: {args.threads // 2} each), "
        f"prompt {args.prompt} + {args.new} greedy steps"
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        got = {config: run(store, config, args) for config in CONFIGS}
        rounds.append(got)
        one = got["one"]
        cells = [f"{c} {1e3 * got[c]['step_s']:.1f} ms ({got[c]['step_s'] / one['step_s']:.3f})" for c in CONFIGS]
        differ = [c for c in CONFIGS if got[c]["tokens"] != one["tokens"]]
        print(f"round {r + 1}: " + ", ".join(cells) + f"; tokens other than one's: {differ or 'none'}", flush=True)
    ratios = {c: statistics.median(g[c]["step_s"] / g["one"]["step_s"] for g in rounds) for c in CONFIGS}
    print("median ratio to one batch: " + ", ".join(f"{c} {v:.3f}" for c, v in ratios.items()))
    summary = {c: [{k: v for k, v in g[c].items() if k != "tokens"} for g in rounds] for c in CONFIGS}
    shape = {"batch": args.batch, "threads": args.threads, "prompt": args.prompt, "new": args.new}
    print(json.dumps({"features": features, **shape, "ratios": ratios, "runs": summary}))


if __name__ == "__main__":
    main()
