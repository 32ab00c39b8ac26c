"""What the KV cache's dtype does to the model's next-token distributions, on the decode path a night runs.

The demo's Gemma 3 270M (the int4 store ``llamacpp.py`` converts from the GGUF and caches) reads the bundled English
and Russian news, then the English and Russian sentences of ``data/stance``'s dev splits (``SOURCE.md``: public news
sentences), teacher-forced: ``--rows`` rows of ``--length`` tokens (the texts in turn), a prefill of the
first ``--prefill`` tokens, then one decode step a position, each fed the text's own next token: every step's
attention reads the cache as that dtype stores it (an int8 cache's codes and scales, by ``attend.c``). The
reference computes in fp32 over an fp32 cache; each other configuration (compute dtype x KV dtype: the plan's bf16
cache, int8) steps in lockstep beside it. Printed per configuration: the mean negative log-likelihood of the text's
next tokens, the mean KL divergence of its distribution from the reference's (nats), and how often its top token is
the reference's. The CPU's features head the table; the last line is one JSON object.

    python benchmarks/kv_quality.py [--rows 8] [--length 320] [--prefill 32] [--threads 2] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llamacpp import DEFAULT_CACHE, cpu_features, demo_gguf, log, store_for
from sampling import news_texts

STANCE = Path(__file__).resolve().parent / "data" / "stance"


def texts() -> list[str]:
    """The bundled news items, then the stance dev splits' sentences (their last column), English and Russian."""
    sentences = [
        line.rstrip("\n").split("\t")[-1]
        for name in ("en_dev.tsv", "ru_dev.tsv")
        for line in (STANCE / name).read_text(encoding="utf-8").splitlines(keepends=True)
        if not line.startswith("#")
    ]
    return news_texts() + sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=320, help="tokens a row")
    parser.add_argument("--prefill", type=int, default=32, help="tokens a row prefilled before the decode steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="llama.cpp build and store cache")
    args = parser.parse_args()

    import torch

    from robot_llm.llm.model import Model, ModelSettings, Policy
    from robot_llm.llm.plan.cpu import cpu_has_native_bf16

    store = store_for(demo_gguf(), args.cache)
    native = "bf16" if cpu_has_native_bf16() else "fp32"
    configs = [("fp32", "fp32"), (native, "bf16"), (native, "int8")]
    if native == "bf16":
        configs += [("fp32", "bf16"), ("fp32", "int8")]
    log(f"{cpu_features()}; {args.rows} rows of {args.length} tokens, {configs[1:]} against {configs[0]}")
    opened = {
        c: Model.open(
            ModelSettings(vocab=store, store=store, device="cpu"),
            Policy(device="cpu", compute_dtype=c[0], kv_dtype=c[1], weight_home="ram", threads=args.threads),
        )
        for c in configs
    }
    tokenizer = opened[configs[0]].tokenizer
    stream = [t for text in texts() for t in tokenizer.encode(text + "\n")]
    need = args.rows * args.length
    if len(stream) < need:
        raise SystemExit(f"the texts have {len(stream)} tokens, fewer than {args.rows} x {args.length}")
    ids = torch.tensor(stream[:need]).view(args.rows, args.length)
    caches = {c: m.engine.new_cache(args.rows, args.length) for c, m in opened.items()}
    totals: dict[tuple[str, str], dict[str, float]] = {c: {"nll": 0.0, "kl": 0.0, "top": 0.0} for c in configs}
    steps = 0
    for t in range(args.prefill, args.length):
        if t == args.prefill:
            logits = {c: m.engine.forward(ids[:, :t], caches[c], last_only=True)[:, -1] for c, m in opened.items()}
        else:
            logits = {c: m.engine.forward(ids[:, t - 1 : t], caches[c])[:, -1] for c, m in opened.items()}
        reference = torch.log_softmax(logits[configs[0]].double(), -1)
        for c in configs:
            logp = torch.log_softmax(logits[c].double(), -1)
            totals[c]["nll"] -= logp.gather(-1, ids[:, t : t + 1]).sum().item()
            totals[c]["kl"] += (reference.exp() * (reference - logp)).sum().item()
            totals[c]["top"] += (logp.argmax(-1) == reference.argmax(-1)).sum().item()
        steps += args.rows
        if (t - args.prefill) % 64 == 0:
            log(f"position {t} of {args.length}")
    for m in opened.values():
        m.close()
    rows: list[dict[str, Any]] = []
    features = cpu_features()
    print(f"CPU: {features['cpu']}; AVX512-BF16 {features['avx512_bf16']}; torch kernels: {features['aten']}")
    print(f"Gemma 3 270M int4, {args.rows} x {args.length} tokens of news, {steps} decode positions")
    print("| compute | KV cache | mean NLL | mean KL to fp32/fp32 (nats) | top token agrees |")
    print("|---|---|---|---|---|")
    for c in configs:
        row = {"compute": c[0], "kv": c[1], **{k: v / steps for k, v in totals[c].items()}}
        rows.append(row)
        print(f"| {c[0]} | {c[1]} | {row['nll']:.5f} | {row['kl']:.6f} | {100 * row['top']:.2f} % |")
    print(json.dumps({"features": features, "steps": steps, "rows": rows}))


if __name__ == "__main__":
    main()
