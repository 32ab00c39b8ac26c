"""The rotary tables of a process's first step are its later steps': torch 2.13's first cos of a process, split over
threads, can compute one thread's part another way (a 2-core VM, 2 threads: 1 process in 4-6 in plain torch, and 3
Gemma 3 270M first prefills in 8 differed from the next one's; 0 in 8 with the warm-up), so :attr:`StepInfo.rotary`
runs cos and sin over every thread's share of values, once per thread count, before its tables."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from robot_llm.llm.families import family
from robot_llm.llm.families.family import StepInfo, rope_inv_freq


class _Trig(TorchDispatchMode):
    """The sizes of every cos and sin, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("cos", "sin"):
            self.calls.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def _step(rows: int) -> StepInfo:
    positions = torch.arange(64)[None].expand(rows, 64)
    mask = torch.zeros(rows, 1, 64, 64, dtype=torch.bool)
    return StepInfo(positions, mask, {}, {"rope": rope_inv_freq(10000.0, 256)}, torch.float32)


def test_the_rotary_warms_cos_and_sin_over_every_thread_once_per_thread_count() -> None:
    before = torch.get_num_threads()
    family.warm_trigonometry.cache_clear()
    try:
        for threads, warms in ((2, True), (2, False), (3, True)):  # once per thread count
            torch.set_num_threads(threads)
            with _Trig() as seen:
                cos, sin = _step(4).rotary["rope"]
            tables = [("cos", 4 * 64 * 256), ("sin", 4 * 64 * 256)]
            warm = [("cos", threads * 65536), ("sin", threads * 65536)] if warms else []
            assert seen.calls == warm + tables  # the warm-up before the tables: 65,536 values a thread
            assert cos.shape == sin.shape == (4, 64, 1, 256)
    finally:
        torch.set_num_threads(before)
        family.warm_trigonometry.cache_clear()
