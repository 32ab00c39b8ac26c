"""What int8 activations cost in accuracy: the next-token distributions of the night's store, per activation path,
against the dequantized GGUF computed in fp32, over thousands of tokens of public financial news.

    python benchmarks/int8_accuracy.py [--work DIR] [--tokens 8192] [--chunk 512] [--threads 2]
        [--levels 127,63] [--kind native|avx2]

The model is the demo's Gemma 3 270M Q4_K_M GGUF. The reference is its fp32 store (every weight as the file
decodes it) computed in fp32 with no int8 activations; the candidates are the store ``model convert --dtype int4``
makes of it (the night's), computed in fp32:

- ``weight-only``: ``ROBOT_LLM_INT8_ACTIVATIONS=0``, the store's own cost (its int8 matrices, the int8 head);
- ``int8 act, levels L``: int8 activations whose codes are within -L..L (``ROBOT_LLM_ACTIVATION_LEVELS``; levels
  other than 127 exist on the AVX2 body only, so ``--kind avx2`` runs the candidates as that kind:
  ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ROBOT_LLM_HIDE_CPU_FLAGS=avx512_bf16,amx_bf16
  MKL_ENABLE_INSTRUCTIONS=AVX2``, which compiles ``gemv.c``'s AVX2 body).

The text: the rows of ``benchmarks/data/stance/*.tsv`` (Twitter Financial News Sentiment, MIT; RuSentNE-2023;
``SOURCE.md``), ``benchmarks/data/headlines.tsv`` and the bundled demo feeds, joined by newlines into documents
of ``--chunk`` tokens (BOS first, not scored), ``--tokens`` in all, English and Russian interleaved. Financial
PhraseBank is not used.

Every configuration runs in its own fresh process. The reference writes each scored position's 64 most likely
tokens and their log-probabilities; every candidate then gives, per position, KL(reference || candidate) over
those 64 tokens and the rest of the vocabulary as one bucket (a lower bound of the full KL, tight where the 64
hold most of the mass), and whether its argmax is the reference's (greedy decoding follows the same token).
Printed per configuration: mean and 99th-percentile KL (nats), top-1 agreement, the perplexity of the text itself
and its change against the reference, and the CPU's features. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOP = 64
AVX2_KIND = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ROBOT_LLM_HIDE_CPU_FLAGS": "avx512_bf16,amx_bf16",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def texts() -> list[str]:
    """Every news text, English and Russian interleaved (so that a short ``--tokens`` holds both)."""
    sys.path.insert(0, str(HERE))
    from quality import documents

    by_lang: dict[str, list[str]] = {"en": [], "ru": []}
    for path in [*sorted((HERE / "data" / "stance").glob("*.tsv")), HERE / "data" / "headlines.tsv"]:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line[:1] != "#" and line.strip():
                fields = line.split("\t")
                by_lang["en" if fields[0] == "en" else "ru"].append(fields[-1].strip())
    for lang, docs in documents().items():
        by_lang[lang].extend(docs)
    out = []
    for i in range(max(map(len, by_lang.values()))):
        out.extend(lang_texts[i] for lang_texts in by_lang.values() if i < len(lang_texts))
    return out


def chunks(tokenizer: object, total: int, size: int) -> list[list[int]]:
    """Documents of ``size`` tokens (BOS first) cut from the texts joined by newlines, ``total`` scored in all."""
    ids: list[int] = []
    for text in texts():
        ids += tokenizer.encode_pieces_ids(text + "\n")  # type: ignore[attr-defined]
    bos = [tokenizer.bos_id]  # type: ignore[attr-defined]
    out, at = [], 0
    while total > 0 and at < len(ids):
        take = min(size - len(bos), total, len(ids) - at)  # each scored: a token's next is predicted
        out.append([*bos, *ids[at : at + take]])
        at, total = at + take, total - take
    return out


def child(store: Path, reference: Path, threads: int, total: int, size: int, write: bool) -> dict[str, object]:
    """One configuration: the store computed in fp32 over the chunks; writes (``write``) or scores against the
    reference's top tokens."""
    import torch

    sys.path.insert(0, str(HERE))
    from quality import open_fp32

    from robot_llm.llm.plan.cpu import cpu_flags
    from robot_llm.llm.store import gemv

    torch.set_num_threads(threads)
    opened = open_fp32(store, threads)
    docs = chunks(opened.tokenizer, total, size)
    ref = None if write else torch.load(reference)
    tops, kls, agree, nll, count = [], [], 0, 0.0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        for n, ids in enumerate(docs):
            logp = torch.log_softmax(opened.engine.forward(torch.tensor([ids]))[0, :-1].float(), dim=-1)
            nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
            count += len(ids) - 1
            if write:
                tops.append(logp.topk(TOP, dim=-1))
                continue
            values, index = ref["values"][n], ref["index"][n]
            p, q = values.exp(), logp.gather(1, index)
            rest_p, rest_q = (1 - p.sum(1)).clamp_min(1e-12), (1 - q.exp().sum(1)).clamp_min(1e-12)
            kls.append((p * (values - q)).sum(1) + rest_p * (rest_p.log() - rest_q.log()))
            agree += int((logp.argmax(-1) == index[:, 0]).sum())
    seconds = time.perf_counter() - started
    lib = gemv.kernels()
    body = "none" if lib is None else f"{lib.int8_mm_body}, levels {lib.activation_levels}"
    opened.close()
    result: dict[str, object] = {"tokens": count, "ppl": math.exp(nll / count), "seconds": seconds, "body": body}
    result["cpu"] = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))
    if write:
        torch.save({"values": [t.values for t in tops], "index": [t.indices for t in tops]}, reference)
        return result
    kl = torch.cat(kls)
    result.update(kl=float(kl.mean()), kl99=float(kl.quantile(0.99)), top1=agree / count)
    return result


def run(name: str, store: Path, reference: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """``child`` in a fresh process with ``env`` added; its result."""
    cmd = [sys.executable, __file__, "--child", str(store), "--reference", str(reference)]
    cmd += ["--threads", str(args.threads), "--tokens", str(args.tokens), "--chunk", str(args.chunk)]
    cmd += ["--write"] if name == "reference" else []
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder for the stores (default: a temporary one)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens scored")
    parser.add_argument("--chunk", type=int, default=512, help="tokens a document (a night's prompt)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--levels", default="127,63", help="activation levels of the int8 candidates")
    parser.add_argument("--kind", choices=("native", "avx2"), default="avx2", help="the CPU kind the candidates run")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reference, args.threads, args.tokens, args.chunk, args.write)))
        return
    sys.path.insert(0, str(HERE))
    from quality import stores

    with tempfile.TemporaryDirectory(prefix="robot-llm-int8-accuracy-") as tmp:
        work = args.work or Path(tmp)
        paths = stores(work, ["fp32", "gguf-int4"])
        reference = work / "reference-top.pt"
        kind = AVX2_KIND if args.kind == "avx2" else {}
        configs = [("reference", paths["fp32"], {"ROBOT_LLM_INT8_ACTIVATIONS": "0"})]
        configs.append(("weight-only", paths["gguf-int4"], {**kind, "ROBOT_LLM_INT8_ACTIVATIONS": "0"}))
        for levels in args.levels.split(","):
            env = {**kind, "ROBOT_LLM_INT8_ACTIVATIONS": "1", "ROBOT_LLM_ACTIVATION_LEVELS": levels.strip()}
            configs.append((f"int8 act, levels {levels.strip()}", paths["gguf-int4"], env))
        results = {}
        for name, store, env in configs:
            results[name] = run(name, store, reference, args, env)
            print(f"  {name}: {results[name]['seconds']:.0f} s", flush=True)
    base = results["reference"]
    print(f"\nCPU: {base['cpu']}; candidates as the {args.kind} kind; {base['tokens']} tokens, {args.threads} threads")
    print(f"{'configuration':<22} {'body':<18} {'KL mean':>9} {'KL p99':>8} {'top-1':>7} {'ppl':>8} {'ppl Δ':>8}")
    for name, r in results.items():
        if name == "reference":
            print(f"{name:<22} {'fp32 store':<18} {'':>9} {'':>8} {'':>7} {r['ppl']:>8.3f}")
            continue
        delta = 100 * (r["ppl"] / base["ppl"] - 1)
        print(
            f"{name:<22} {r['body']:<18} {r['kl']:>9.5f} {r['kl99']:>8.4f} {r['top1']:>7.2%} "
            f"{r['ppl']:>8.3f} {delta:>+7.2f}%"
        )
    print(json.dumps({"kind": args.kind, "results": results}))


if __name__ == "__main__":
    main()
