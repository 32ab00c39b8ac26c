"""``robot-llm model convert | verify | plan``: weight store and memory planner commands.

:func:`add_engine_commands` adds them to the ``model`` subcommand group.
Torch is imported only when convert or verify runs, and when plan measures this machine's rates
(:mod:`robot_llm.llm.plan.rates`; planning for a machine given by ``--ram-gb`` is pure arithmetic).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError
from robot_llm.llm.store.quant import DEFAULT_INT4_GROUP, GGUF_INT4_GROUP

if TYPE_CHECKING:
    from robot_llm.llm.families.config import ModelConfig

GB = 1e9
#: The ``model plan`` option that states each rate (named where a rate is assumed).
RATE_FLAGS = {
    "disk_read_bps": "--disk-gbps",
    "ram_bps": "--ram-gbps",
    "cpu_flops": "--cpu-tflops",
    "cpu_bf16_flops": "--cpu-bf16-tflops",
    "cpu_int8_ops": "--cpu-int8-tops",
    "ram_bf16_bps": "--ram-gbps",  # unmeasured, bf16 reads at the one RAM rate
    "h2d_bps": "--h2d-gbps",
    "gpu_flops": "--gpu-tflops",
}


def _progress_bar(total_label: str) -> Any:
    """A tqdm bar on a terminal; None elsewhere (log lines carry the progress then)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc=total_label, unit="file")


def _preset(name: str, *, release: bool = False) -> ModelConfig:
    """The named config (``release``: a YaLM one, the only family with a release folder); a clear error else."""
    from robot_llm.llm.families import registry

    try:
        config = registry.preset(name)
    except ValueError as exc:
        raise RobotLLMError(f"--preset: {exc}") from None
    if release and config.family != "yalm":
        raise RobotLLMError(f"--preset {name} is a {config.family} model: a release folder is YaLM's")
    return config


def _convert(args: argparse.Namespace) -> int:
    from robot_llm.llm.store.layout import StoreError
    from robot_llm.llm.store.writer import convert

    config = _preset(args.preset, release=True) if args.preset else None
    bar = _progress_bar("convert")

    def on_file(entry: Any, done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(entry.name)

    source = args.release_dir
    if args.all_int4 and args.dtype != "int4":
        raise RobotLLMError("--all-int4 goes with --dtype int4")
    try:
        if source.suffix == ".gguf" or ((source / "config.json").is_file() and any(source.glob("*.safetensors"))):
            from robot_llm.llm.store.importers import import_model

            manifest = import_model(
                source,
                args.store_dir,
                dtype=args.dtype,
                group_size=args.group_size,
                tokenizer=args.tokenizer,
                on_file=on_file,
                all_int4=args.all_int4,
            )
        else:
            manifest = convert(
                source,
                args.store_dir,
                dtype=args.dtype,
                config=config,
                group_size=args.group_size or DEFAULT_INT4_GROUP,
                trust_pickle=args.trust_pickle,
                on_file=on_file,
            )
    except StoreError as exc:
        raise RobotLLMError(str(exc)) from exc
    finally:
        if bar is not None:
            bar.close()
    print(f"{args.store_dir}: {len(manifest.files)} files, {manifest.total_bytes / 2**30:.2f} GiB, {manifest.dtype}")
    counts = manifest.matrix_counts()
    if manifest.dtype == "int4":
        print(
            f"layer matrices: {counts.get('int4', 0)} int4, {counts.get('int8', 0)} int8"
            + (
                " (int8: the GGUF file keeps them at more than 5 bits per weight, which int4 would lose; "
                "--all-int4 makes them int4 too)"
                if counts.get("int8")
                else ""
            )
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from robot_llm.llm.store.layout import StoreError
    from robot_llm.llm.store.reader import verify

    bar = _progress_bar("verify")

    def on_file(entry: Any, done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)
        else:
            logging.getLogger(__name__).info("checked %s (%d/%d)", entry.name, done, total)

    try:
        problems = verify(args.store_dir, on_file=on_file, record_checksums=args.record_checksums)
    except StoreError as exc:
        raise RobotLLMError(str(exc)) from exc
    finally:
        if bar is not None:
            bar.close()
    for problem in problems:
        print(problem)
    print(f"{args.store_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 0 if not problems else 1


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from robot_llm.llm.engine.runtime import GPU_RATES_ASSUMED
    from robot_llm.llm.plan.cpu import cpu_has_native_bf16
    from robot_llm.llm.plan.machine import Machine, detect_machine
    from robot_llm.llm.plan.planner import PlanError, Work, plan
    from robot_llm.llm.plan.rates import describe_rates, measure_rates

    config: ModelConfig
    weight_dtype, layer_sizes, int8_share = args.dtype or "fp16", None, 0.0
    if args.preset:
        config = _preset(args.preset)
    elif args.store:
        from robot_llm.llm.store.reader import read_manifest

        manifest = read_manifest(args.store)
        config = manifest.config
        if args.dtype is None:  # the store's own bytes per layer (an int4 store may keep some matrices int8)
            weight_dtype, layer_sizes, int8_share = manifest.dtype, manifest.layer_bytes(), manifest.int8_share()
    else:
        raise RobotLLMError("give --preset NAME or --store DIR")
    given = {
        field: value * scale
        for field, value, scale in (
            ("disk_read_bps", args.disk_gbps, GB),
            ("h2d_bps", args.h2d_gbps, GB),
            ("ram_bps", args.ram_gbps, GB),
            ("gpu_flops", args.gpu_tflops, 1e12),
            ("cpu_flops", args.cpu_tflops, 1e12),
            ("cpu_bf16_flops", args.cpu_bf16_tflops, 1e12),
            ("cpu_int8_ops", args.cpu_int8_tops, 1e12),
        )
        if value
    }
    disk_bps = given.get("disk_read_bps")
    if disk_bps is None and args.store:
        from robot_llm.llm.engine.runtime import store_read_bps

        disk_bps = store_read_bps(Path(args.store))
    # --ram-gb describes another machine: none of its rates can be measured here. Without it the CPU and RAM
    # are this machine's (measured); the GPU too unless --gpu-gb gives another (then its rates are assumed,
    # and this machine's GPU is not touched).
    this_cpu = args.ram_gb is None
    this_gpu = this_cpu and args.gpu_gb is None
    if this_cpu:
        machine = detect_machine(disk_bps, gpu=this_gpu)
        if not this_gpu:
            machine = replace(machine, gpu_bytes=int(args.gpu_gb * GB), gpu_bf16=args.gpu_bf16 != "no")
    else:
        machine = Machine(
            ram_bytes=int(args.ram_gb * GB),
            gpu_bytes=int((args.gpu_gb or 0) * GB),
            gpu_bf16=args.gpu_bf16 != "no",
            cpu_bf16=cpu_has_native_bf16() if args.cpu_bf16 is None else args.cpu_bf16 == "yes",
            cores=args.cores,
            **({"disk_read_bps": disk_bps} if disk_bps else {}),
        )
    # The GPU's rates are not probed here (the night probes them): the probe's allocation could push a night
    # running on this GPU out of its memory. They are assumed, and labelled so.
    machine, sources = measure_rates(machine, given, probe_cpu=this_cpu, probe_gpu=False)
    if disk_bps is not None and "disk_read_bps" not in given:
        sources["disk_read_bps"] = "measured under the store"
    night = {"h2d_bps", "gpu_flops"} if this_gpu and machine.has_gpu else set()
    sources = {
        k: (
            f"{GPU_RATES_ASSUMED}, {RATE_FLAGS[k]} states yours"
            if k in night
            else f"assumed; {RATE_FLAGS[k]} states yours"
        )
        if v == "assumed"
        else v
        for k, v in sources.items()
    }
    work = Work(args.prompts, args.prompt_tokens, args.max_new_tokens, stance_tokens=args.stance_tokens)
    print(
        f"model: {args.preset or args.store} ({config.num_layers} layers, hidden {config.hidden_size}); "
        f"work: {work.num_prompts} prompts x {work.prompt_tokens} tokens + {work.max_new_tokens} new"
        + (f", stance over {work.stance_tokens} cue and label tokens" if work.stance_tokens else "")
    )
    print(
        f"machine: GPU {machine.gpu_bytes / GB:.0f} GB, RAM {machine.ram_bytes / GB:.0f} GB, "
        f"CPU {machine.cores} cores, {machine.compute_threads} compute thread(s)"
    )
    print(f"rates: {describe_rates(machine, sources)}")
    try:
        result = plan(
            config,
            work,
            machine,
            weight_dtype=weight_dtype,
            layer_sizes=layer_sizes,
            int8_share=int8_share,
            max_batch_size=args.max_batch_size,
            memory_budget_bytes=int(args.budget_gb * GB) if args.budget_gb else None,
        )
    except PlanError as exc:
        print(f"refused: {exc}")
        return 1
    print(result.describe())
    return 0


def add_engine_commands(model_sub: Any) -> None:
    """Add ``convert``, ``verify`` and ``plan`` to the ``model`` subparsers."""
    conv = model_sub.add_parser(
        "convert", help="convert a YaLM release, a GGUF file or a Hugging Face folder into a streaming weight store"
    )
    conv.add_argument(
        "release_dir",
        metavar="SOURCE",
        type=Path,
        help="YaLM release folder, .gguf file, or Hugging Face folder (config.json, *.safetensors, tokenizer.json)",
    )
    conv.add_argument("store_dir", type=Path, help="store folder to write (resumes an unfinished one)")
    conv.add_argument(
        "--dtype", choices=["fp16", "bf16", "fp32", "int8", "int4"], default="fp16", help="default: %(default)s"
    )
    conv.add_argument(
        "--group-size",
        type=int,
        help=f"int4's scale group: 32, 64 or 128 input columns (default {GGUF_INT4_GROUP} for a GGUF file, whose "
        f"weights are block-quantised in runs of 32, else {DEFAULT_INT4_GROUP}; int8 is per output channel)",
    )
    conv.add_argument(
        "--all-int4",
        action="store_true",
        help="with --dtype int4 from a GGUF file: make every layer matrix int4, also those the file keeps at more "
        "than 5 bits per weight (Q5_0, Q6_K, Q8_0, ...), which are otherwise stored int8: the smallest store, "
        "at a cost in quality (Gemma 3 270M Q4_K_M: see README)",
    )
    # Preset names are checked when the command runs: the configs live with their families, which import torch.
    conv.add_argument("--preset", help="YaLM model config when the release has no config.json (e.g. yalm-100b)")
    conv.add_argument("--trust-pickle", action="store_true", help="allow pickled objects in release files")
    conv.add_argument("--tokenizer", type=Path, help="tokenizer.json to store instead of the source's own (GGUF/HF)")
    conv.set_defaults(handler=_convert)

    ver = model_sub.add_parser("verify", help="check every store file against its manifest")
    ver.add_argument("store_dir", type=Path)
    ver.add_argument(
        "--record-checksums",
        action="store_true",
        help="a store converted before block checksums were recorded: add them to its manifest when every file "
        "matches its sha256 (nights then verify its bytes as they stream)",
    )
    ver.set_defaults(handler=_verify)

    pl = model_sub.add_parser("plan", help="plan batch size and memory placement for a batch job")
    pl.add_argument("--preset", help="a named model config, e.g. yalm-100b or llama-3.1-70b (or --store)")
    pl.add_argument(
        "--store", type=Path, help="a converted store (its config and weights' bytes; measures its read bandwidth)"
    )
    pl.add_argument(
        "--dtype",
        choices=["fp16", "bf16", "fp32", "int8", "int4"],
        help="stored weight dtype (default: the store's with --store, else fp16)",
    )
    pl.add_argument("--prompts", type=int, default=300, help="number of prompts (default: %(default)s)")
    pl.add_argument(
        "--prompt-tokens", type=int, default=512, help="longest prompt, BOS included (default: %(default)s)"
    )
    pl.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    pl.add_argument(
        "--gpu-gb",
        type=float,
        help="GPU memory, GB (0 = CPU only; default: this machine's GPU, none on a machine given by --ram-gb)",
    )
    pl.add_argument(
        "--ram-gb", type=float, help="RAM of another machine, GB (default: this machine's, its rates measured)"
    )
    pl.add_argument("--budget-gb", type=float, help="RAM the run may use, GB (default: all)")
    pl.add_argument(
        "--disk-gbps", type=float, help="disk sequential read, GB/s (default: measured with --store, else 3)"
    )
    pl.add_argument(
        "--h2d-gbps",
        type=float,
        help="host-to-GPU copy bandwidth, GB/s (default 12; a night measures its GPU's)",
    )
    pl.add_argument(
        "--ram-gbps",
        type=float,
        help="CPU memory read bandwidth, GB/s (default: measured on this machine, else 10): bounds a small batch's "
        "decode step over RAM-homed layers, and decides whether a decode step attends over a KV cache "
        "in RAM there (FlexGen's CPU attention) or copies it to the GPU",
    )
    pl.add_argument("--gpu-tflops", type=float, help="sustained GPU TFLOP/s (default 30; a night measures its GPU's)")
    pl.add_argument(
        "--cpu-tflops",
        type=float,
        help="sustained CPU fp32 TFLOP/s on all cores (default: measured on this machine, else 0.5)",
    )
    pl.add_argument(
        "--cpu-bf16-tflops",
        type=float,
        help="sustained CPU bf16 TFLOP/s on all cores (default: measured where this CPU has native bf16, else 1.0)",
    )
    pl.add_argument(
        "--cpu-int8-tops",
        type=float,
        help="sustained CPU int8 x int8 TOP/s on all cores, which many-row calls of a quantized store meet "
        "(default: measured where int8 activations run here, else none: those calls widen the codes)",
    )
    pl.add_argument(
        "--cpu-bf16", choices=["yes", "no"], help="the CPU has native bf16 (default: as this machine's CPU)"
    )
    pl.add_argument(
        "--gpu-bf16",
        choices=["yes", "no"],
        help="a GPU given by --gpu-gb has native bf16 (compute capability 8.0+; default: yes): Llama and Gemma 3 "
        "compute in bf16 there, else Llama in fp16 and Gemma 3 in fp32 (YaLM always fp16)",
    )
    pl.add_argument(
        "--cores", type=int, default=8, help="CPU cores of a machine given by --ram-gb (default: %(default)s)"
    )
    pl.add_argument(
        "--stance-tokens",
        type=int,
        default=16,
        help="cue and label tokens per row of the stance pass from the KV cache (0 = none; default: %(default)s)",
    )
    pl.add_argument("--max-batch-size", type=int, help="upper bound on the batch size")
    pl.set_defaults(handler=_plan)
