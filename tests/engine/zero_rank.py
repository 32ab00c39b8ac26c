"""One rank of the 2-process DeepSpeed test: fixture logits under ZeRO-3 with parameters split across ranks.

Run by ``test_deepspeed.py`` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set:
``python zero_rank.py FIXTURE_DIR OUT_FILE``; writes ``{prompt_i: logits}`` and the local partition sizes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from robot_llm.llm.engine.deepspeed import DeepSpeedModel
from robot_llm.llm.families.yalm import YalmConfig


def main(fixture: Path, out: Path) -> None:
    torch.set_num_threads(1)
    cfg = YalmConfig.from_json(fixture / "config.json")
    model = DeepSpeedModel(fixture / "weights", cfg, offload="cpu", dtype="fp32")
    expected = json.loads((fixture / "expected.json").read_text(encoding="utf-8"))
    logits = {
        f"prompt_{i}": model.forward(torch.tensor([p["token_ids"]]))[0] for i, p in enumerate(expected["prompts"])
    }
    local = sum(p.ds_tensor.numel() for p in model.engine.module.parameters())
    total = sum(p.ds_numel for p in model.engine.module.parameters())
    torch.save({"logits": logits, "local_numel": local, "total_numel": total}, out)
    model.close()
    # Both ranks leave the group together, then skip the C++ static destructors: under load one rank now and then
    # aborted there (SIGABRT, "terminate called without an active exception", a gloo thread still joinable) after
    # its result was written, failing a check whose subject is the partition and the logits.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
