"""DeepSpeed ZeRO-3 offload backend on the CPU: cpu and NVMe offload, and two ranks over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robot_llm.commands.model import check_fixture
from robot_llm.llm.engine.deepspeed import DeepSpeedModel, deepspeed_arch_list, prepare_ops
from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.families.family import random_weights
from robot_llm.llm.families.yalm import YalmConfig
from robot_llm.llm.store.writer import write_store

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Hidden 512 in fp32: every layer matrix is >= 1 MiB, the smallest tensor ZeRO swaps to NVMe.
NVME_CONFIG = YalmConfig(
    num_layers=2,
    hidden_size=512,
    embedding_size=128,
    intermediate_size=1024,
    num_attention_heads=8,
    max_position_embeddings=64,
    vocab_size=600,
)


def test_fixture_passes_with_cpu_offload(tiny_dir: Path) -> None:
    result = check_fixture(tiny_dir, "deepspeed", dtype="fp32", device="cpu", offload="cpu")
    assert result["max_abs_diff"] <= 1e-4
    assert result["greedy_match"] == result["greedy_total"] == 4 and result["tokens_match"]


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("9.0a", "9.0"),
        ("9.0a;10.0f+PTX", "9.0;10.0+PTX"),
        ("8.6 9.0a  12.0+PTX", "8.6;9.0;12.0+PTX"),
        ("7.5;8.0", "7.5;8.0"),
    ],
)
def test_suffixed_cuda_archs_are_read_as_deepspeed_can(given: str, read: str) -> None:
    assert deepspeed_arch_list(given) == read


def test_prepare_ops_hands_deepspeed_an_arch_list_its_builder_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    # An H200's CUDA image sets TORCH_CUDA_ARCH_LIST=9.0a: DeepSpeed's JIT build of async_io then failed
    # before compiling anything (benchmarks/gpu_check.sh, NVMe offload).
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # the CUDA builder, whatever this machine has

    def capability_args(arch_list: str) -> list[str]:
        builder = AsyncIOBuilder()
        builder.jit_mode, builder._jit_arch_list = True, arch_list
        return builder.compute_capability_args()

    with pytest.raises(ValueError):  # when this stops raising, deepspeed_arch_list can go
        capability_args("9.0a")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;10.0f+PTX")
    prepare_ops("cpu")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0;10.0+PTX"
    capability_args(os.environ["TORCH_CUDA_ARCH_LIST"])


def test_nvme_offload_writes_swap_files_and_matches_the_model(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    weights = random_weights(NVME_CONFIG, seed=3)
    modules = [("embedding", 0, weights.resident["embedding"]), ("projector", 0, weights.resident["projector"])]
    modules += [("layer", i, p) for i, p in enumerate(weights.layers)] + [("output", 0, weights.resident["output"])]
    write_store(tmp_path / "store", NVME_CONFIG, modules, dtype="fp32")
    model = DeepSpeedModel(tmp_path / "store", NVME_CONFIG, offload="nvme", dtype="fp32", offload_dir=tmp_path / "nvme")
    swapped = [p for p in model.engine.module.parameters() if p.ds_tensor.final_location == OffloadDeviceEnum.nvme]
    files = model.swap_files()
    # The five matrices of each layer (and the embedding) live in swap files, not in RAM.
    assert len(swapped) >= 5 * NVME_CONFIG.num_layers and len(files) >= len(swapped)
    assert all(f.stat().st_size >= 2**20 for f in files)

    reference = Yalm(NVME_CONFIG, weights)
    ids = torch.randint(5, 600, (2, 7), generator=torch.Generator().manual_seed(0))
    cache, ref_cache = model.new_cache(2, 12), reference.new_cache(2, 12)
    ours, theirs = model.forward(ids, cache), reference.forward(ids, ref_cache)
    assert (ours - theirs).abs().max() <= 1e-4
    for _ in range(3):
        token = theirs[:, -1:].argmax(-1)
        assert torch.equal(ours[:, -1:].argmax(-1), token)
        ours, theirs = model.forward(token, cache), reference.forward(token, ref_cache)
        assert (ours - theirs).abs().max() <= 1e-4
    model.close()


def test_two_ranks_over_gloo_partition_the_parameters(tiny_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(REPO),
        }
        cmd = [sys.executable, str(HERE / "zero_rank.py"), str(tiny_dir), str(tmp_path / f"rank{rank}.pt")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    reference = torch.load(tiny_dir / "logits.pt", weights_only=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # Each rank holds about half of every partitioned parameter.
        assert result["local_numel"] < 0.6 * result["total_numel"]
        for name, logits in result["logits"].items():
            assert (logits - reference[name]).abs().max() <= 1e-4


def test_followups_and_a_shared_head_under_deepspeed(tiny_dir: Path) -> None:
    # The slot state (masked rows, tree steps, shared head) lives in the cache: ZeRO runs it unchanged.
    from robot_llm.llm.generate import SamplingParams, generate
    from robot_llm.llm.scoring import Followup
    from robot_llm.llm.tokenizer import YalmTokenizer

    cfg = YalmConfig.from_json(tiny_dir / "config.json")
    tokenizer = YalmTokenizer(tiny_dir / "vocab" / "voc_tiny.sp")
    model = DeepSpeedModel(tiny_dir / "weights", cfg, offload="cpu", dtype="fp32")
    reference = Yalm.from_release(str(tiny_dir / "weights"), cfg)
    prompts = ["Рубль ослаб к доллару, а индекс" + t for t in (" вырос", " упал на 2% за день", "")]
    params = [SamplingParams(max_new_tokens=n, greedy=True) for n in (5, 2, 7)]
    labels = [Followup("\nИтог:", (" рост", " падение"))] * 3
    try:
        ours = generate(model, tokenizer, prompts, params, followups=labels, share_prefix=4)
    finally:
        model.close()
    theirs = generate(reference, tokenizer, prompts, params, followups=labels, batch_size=1)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.followup_logprobs is not None and b.followup_logprobs is not None
        for x, y in zip(a.followup_logprobs, b.followup_logprobs, strict=True):
            assert max(abs(p - q) for p, q in zip(x, y, strict=True)) <= 1e-4


def test_deepspeed_names_the_first_nonfinite_layer(tmp_path: Path) -> None:
    # The layer loop is the one every engine runs (family.forward_pass): ZeRO's modules get its watch too.
    from robot_llm.llm.engine.finite import NonFiniteError, check_logits

    cfg = YalmConfig(
        num_layers=3,
        hidden_size=64,
        embedding_size=32,
        intermediate_size=128,
        num_attention_heads=4,
        max_position_embeddings=32,
        vocab_size=100,
    )
    weights = random_weights(cfg, seed=1)
    key = next(k for k, v in weights.layers[1].items() if v.dim() == 2)
    weights.layers[1][key][3, 3] = float("inf")
    weights.layers[1][key][4, 4] = float("-inf")
    modules = [("embedding", 0, weights.resident["embedding"]), ("projector", 0, weights.resident["projector"])]
    modules += [("layer", i, p) for i, p in enumerate(weights.layers)] + [("output", 0, weights.resident["output"])]
    write_store(tmp_path / "store", cfg, modules, dtype="fp32")
    model = DeepSpeedModel(tmp_path / "store", cfg, offload="cpu", dtype="fp32")
    try:
        logits = model.forward(torch.arange(5, 13).view(2, 4))
        with pytest.raises(NonFiniteError) as info:
            check_logits(logits, model)
    finally:
        model.close()
    assert info.value.where == "layer 1"
