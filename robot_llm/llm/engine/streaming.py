"""Streaming engine: run a model of any family layer by layer from a weight store, a whole batch at a time.

Only the resident modules (embedding, YaLM's projector, the output head) stay on the compute device; the family's
functions (:mod:`robot_llm.llm.families.family`) compute the embedding, each layer and the head. Transformer layers
live in their *home* (the store on disk, or RAM) and pass through two preallocated slots: while layer ``l`` computes
for every row of the batch, a background thread reads layer ``l+1`` into the other slot (pinned host memory, then a
copy stream into a device slot when computing on CUDA). There are two such threads, so a layer's reads join the
disk's queue while the layer before still has requests in flight; what follows a read runs one layer at a time.
Quantized (int8, int4) matrices computed in bf16 or fp32 on the CPU are handed to the family as read (packed,
:mod:`robot_llm.llm.store.quant`): :func:`robot_llm.llm.families.family.linear` runs torch's fused kernels on them at
decode batch sizes; a call of more rows quantizes its activations to int8 where the CPU multiplies int8 by int8
(RAM-homed int8 matrices rotated in place for it once, :func:`~robot_llm.llm.engine.stream_slots.prepare_ram_layer`),
else makes the matrix dense once in a compute buffer. The LM head of a quantized store is held in int8 on the CPU
(:mod:`robot_llm.llm.store.qhead`). Otherwise (fp16 compute on the CPU, or CUDA) quantized and mixed-dtype
layers are converted into compute-dtype buffers: on the CPU by a reader thread, one set per slot, so dequantization
overlaps compute like the read does; on CUDA on the GPU right before use, from the bytes copied up. Slots and
buffers are allocated once and reused for every layer and every step, so memory does not grow with the number of
steps. The last layer of a step prefetches layer 0 of the next step, so decode steps overlap too. A CPU engine
with every layer in RAM and nothing to convert fills its slots on the compute thread (no reader threads).

:class:`StreamingModel` implements :class:`robot_llm.llm.families.yalm.ForwardModel`,
so :mod:`robot_llm.llm.generate` runs on it unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from robot_llm.llm.engine.finite import FiniteWatch
from robot_llm.llm.engine.kv_cache import KVCache
from robot_llm.llm.engine.policy import AttentionHome, KVHome, Task
from robot_llm.llm.engine.stream_slots import (
    UNPREPARED,
    LayerReadError,
    Prepared,
    Slot,
    StreamStats,
    drop_dense,
    kept_for_reuse,
    prepare_ram_layer,
    resolve_device,
    trim_heap,
)
from robot_llm.llm.families.config import embedding_is_head
from robot_llm.llm.families.family import LayerCall, Params, bind_layer, forward_pass, prepare_step, resolve_dtype
from robot_llm.llm.families.registry import family_of
from robot_llm.llm.plan.machine import gpu_has_native_bf16
from robot_llm.llm.plan.planner import gpu_compute_dtype
from robot_llm.llm.store.checksum import DamagedStoreError
from robot_llm.llm.store.diskio import DEFAULT_DEPTH, huge_page_buffer, io_pool, round_up
from robot_llm.llm.store.gemv import matmul_available
from robot_llm.llm.store.int8act import int8_activations_on_cpu
from robot_llm.llm.store.layout import (
    SCALE_SUFFIX,
    FileLayout,
    StoreError,
    aligned_buffer,
    direct_span,
    read_into,
    read_pieces,
)
from robot_llm.llm.store.qhead import QuantizedTable, RowSource
from robot_llm.llm.store.quant import PackedInt4, PackedInt8, fused_on_cpu, int4_kernel_reads_stored_layout
from robot_llm.llm.store.reader import QUANTIZED, Store

log = logging.getLogger(__name__)

WeightHome = Literal["disk", "ram"]

#: Tries of one layer read before the forward pass fails (a transient EIO or short read is retried).
READ_ATTEMPTS = 4
#: Wait before the first retry; doubled before each next one.
READ_BACKOFF_S = 0.05


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class StreamingModel:
    """A model streamed from a :class:`~robot_llm.llm.store.reader.Store`; implements ``ForwardModel``.

    ``home`` is where layers live between uses (``"disk"``: read from the store
    files every step; ``"ram"``: loaded once into CPU memory). ``kv_home`` puts
    the KV cache on the compute device or in CPU RAM. ``micro_batch`` splits the
    rows of a multi-token (prefill) step so activations stay bounded while each
    layer is still read once for the whole batch. ``prefetch=False`` reads
    synchronously (the naive schedule, for comparison). ``ram_layers`` splits
    a disk home: the first that many layers are held in RAM, the rest streamed
    (for RAM that holds part of the model). ``read_depth`` is how many large
    reads of a layer are in flight at once (:mod:`robot_llm.llm.store.diskio`).
    ``kv_dtype`` ``int8``/``int4`` keeps the KV cache compressed
    (:mod:`robot_llm.llm.engine.kvquant`); None keeps it in the compute dtype.
    ``attention_home`` ``"kv"`` runs a decode step's attention where the KV cache
    lives (FlexGen's CPU attention, for a cache in RAM on a GPU machine: the planner
    chooses it when copying the cache up each step would cost more); ``"compute"``
    copies the cache's slice to the compute device.
    ``quantized_head`` holds the LM head (and an embedding tied to it) as int8 per vocabulary row
    (:mod:`robot_llm.llm.store.qhead`); None (default): where a quantized store computes on the CPU.
    The door fixes these (a :mod:`~robot_llm.llm.engine.policy` ``Policy``); one job's ``Task`` goes to each call.
    """

    def __init__(
        self,
        store: Store | str | Path,
        *,
        home: WeightHome = "disk",
        device: str | torch.device = "auto",
        dtype: str | torch.dtype | None = None,
        kv_home: KVHome = "device",
        micro_batch: int | None = None,
        prefetch: bool = True,
        drop_cache: bool = True,
        ram_layers: int = 0,
        read_depth: int = DEFAULT_DEPTH,
        kv_dtype: str | None = None,
        attention_home: AttentionHome = "compute",
        quantized_head: bool | None = None,
    ) -> None:
        self.store = store if isinstance(store, Store) else Store(store)
        self.config = cfg = self.store.config
        self.family = family_of(cfg)
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        if dtype is None:  # as the planner's auto: the family's GPU dtype, fp32 on the CPU
            dtype = gpu_compute_dtype(cfg, gpu_has_native_bf16(self.device)) if self.cuda else "fp32"
        self.dtype = resolve_dtype(dtype)
        self.home = home
        self.kv_device = self.device if kv_home == "device" else torch.device("cpu")
        self.kv_dtype = kv_dtype
        self.attention_home = attention_home
        self.micro_batch = micro_batch
        self.prefetch = prefetch
        if home not in ("disk", "ram"):
            raise ValueError(f"weight home must be 'disk' or 'ram', got {home!r}")
        self.ram_layers = cfg.num_layers if home == "ram" else max(0, min(ram_layers, cfg.num_layers))
        streams = self.ram_layers < cfg.num_layers
        self.drop_cache = drop_cache and streams
        self.read_depth = read_depth
        self.stats = StreamStats()
        self.watch = FiniteWatch()
        self.last_hidden: Tensor | None = None  # the last pass's pre-head states, as InMemoryModel.last_hidden
        # Quantized matrices go to the fused CPU kernels as stored, not widened every pass (quant.fused_on_cpu).
        self.fused = not self.cuda and fused_on_cpu(self.store.manifest.dtype, _DTYPE_NAMES.get(self.dtype, ""))
        self.rope = self.family.rope(cfg)
        # An untied model's embedding is only looked up: on a GPU it stays in host RAM (70B: 2 GiB).
        self.embed_device = self.device if embedding_is_head(cfg) else torch.device("cpu")
        if quantized_head is None:
            quantized_head = not self.cuda and self.store.manifest.dtype in QUANTIZED
        self.quantized_head = quantized_head
        self.resident = {kind: self._load_resident(kind) for kind in cfg.resident_shapes()}
        self.layouts = [self.store.layout("layer", i) for i in range(cfg.num_layers)]
        self.paths = self.store.layer_files()
        self._io = io_pool(read_depth) if read_depth > 1 else None
        # Disk slots take whole files (O_DIRECT reads from offset 0); RAM-homed layers hold data sections.
        slot_bytes = max(
            layout.data_size if i < self.ram_layers else direct_span(layout) for i, layout in enumerate(self.layouts)
        )
        # RAM-homed layers: their bytes once in CPU memory (used in place on the CPU), in one arena of huge pages.
        self.ram: list[Tensor | None] = [None] * cfg.num_layers
        spans = [round_up(layout.data_size) for layout in self.layouts[: self.ram_layers]]
        arena, start = huge_page_buffer(sum(spans)), 0
        for i in range(self.ram_layers):
            held = self.ram[i] = arena[start : start + self.layouts[i].data_size]
            start += spans[i]
            offset = read_into(self.paths[i], self.layouts[i], held, pool=self._io, depth=read_depth)
            self.store.check_read(self.paths[i].name, read_pieces(self.layouts[i], held, offset))
        # Where this CPU's int4 kernel reads another layout than the stored one (AVX2), RAM-homed layers are repacked
        # once here; streamed ones go to gemm.c, which reads the stored layout, or are dequantized by the reader
        # where it does not serve: repacking every pass costs ~3x that (65 vs 20 ms).
        int4 = any(t.dtype == torch.uint8 for layout in self.layouts for t in layout.tensors.values())
        self.repack = self.fused and int4 and not int4_kernel_reads_stored_layout()
        self.widen_int4 = self.repack and not matmul_available()
        # int8 activations (where the CPU has them) need RAM-homed int8 matrices rotated; streamed ones keep their path.
        rotates = self.fused and int8_activations_on_cpu()
        self.ram_prepared = [
            prepare_ram_layer(layout, held, repack=self.repack, rotate=rotates) if held is not None else UNPREPARED
            for layout, held in zip(self.layouts, self.ram, strict=True)
        ]
        self.ram_params: dict[int, Params] = {}
        self.slots = [self._new_slot(slot_bytes) for _ in range(2 if prefetch else 1)]
        # CUDA converts on the compute stream, one layer at a time: one set of buffers serves both slots; so does the
        # fused CPU path, whose quantized matrices are dequantized (if ever) by the compute thread.
        shared = self._compute_buffers()
        for n, slot in enumerate(self.slots):
            slot.buffers = shared if self.cuda or n == 0 else self._compute_buffers(shared if self.fused else None)
        self._next = 0
        self._prefetched: Slot | None = None
        self._current = self.slots[0]
        # Two reader threads: the next layer's reads join the disk pool's queue while the last requests of the layer
        # before are in flight, so the disk never waits at a file's end for the queue to refill; what follows a read
        # runs one layer at a time. Every layer in RAM on the CPU with nothing to convert fills inline: the threads'
        # GIL handoffs cost 28 of a batch-1 decode step's 97 ms (int4 Gemma 3 270M, cProfile, loaded).
        same = self.fused or self.store.manifest.dtype == _DTYPE_NAMES.get(self.dtype)
        inline = not self.cuda and self.ram_layers == cfg.num_layers and same
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="layer-reader") if prefetch and not inline else None
        self._after_read = threading.Lock()
        self._read_busy_until = 0.0
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _load_resident(self, kind: str) -> Params:
        """A resident module in the compute dtype on its device; with ``quantized_head``, its vocabulary-sized
        matrices (the LM head, the embedding tied to it) as int8 tables, quantized from the stored dtype."""
        device = self.embed_device if kind == "embedding" else self.device
        layout = self.store.layout(kind)
        tables = {
            key
            for key, slot in layout.tensors.items()
            if self.quantized_head and len(slot.shape) == 2 and slot.shape[0] == self.config.vocab_size
        }
        params: Params = {}
        for key, slot in layout.tensors.items():
            if key in tables:  # read and quantized a block of rows at a time: the float table is never held
                shape = (slot.shape[0], slot.shape[1])
                rows = RowSource(layout.path, layout.data_offset + slot.start, shape, slot.dtype)
                rotate = not self.cuda and int8_activations_on_cpu()
                table = QuantizedTable.quantize(rows, self.dtype, exact_lookups=kind == "embedding", rotate=rotate)
                params[key] = table  # type: ignore[assignment]
        if len(tables) < len(layout.tensors):
            params.update({k: t.to(device, self.dtype) for k, t in self.store.load(kind).items() if k not in tables})
        return params

    # ------------------------------------------------------------------ buffers

    def _new_slot(self, nbytes: int) -> Slot:
        host = None
        if self.ram_layers < self.config.num_layers:
            host = aligned_buffer(nbytes, pin_memory=self.cuda)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device) if self.cuda else None
        return Slot(host=host, device=device, free=torch.cuda.Event() if self.cuda else None)

    def _compute_buffers(self, shared: Params | None = None) -> Params:
        """One compute-dtype tensor per key whose stored dtype differs from the compute dtype.

        With ``shared``, the quantized matrices' buffers are taken from it (the fused CPU path).
        """
        buffers: Params = {}
        # Streamed int4 matrices the reader dequantizes (see ``widen_int4``) need a buffer per slot: the reader
        # fills the next layer's while the compute thread still uses this one's. A mixed store may hold one
        # key int4 in a layer and int8 in another, so the choice is made per key over every layer.
        streamed = self.widen_int4 and self.ram_layers < self.config.num_layers
        by_reader = {k for layout in self.layouts for k, slot in layout.tensors.items() if slot.dtype == torch.uint8}
        for layout in self.layouts:
            for key, slot in layout.tensors.items():
                if key.endswith(SCALE_SUFFIX) or slot.dtype == self.dtype or key in buffers:
                    continue
                own = streamed and key in by_reader
                if shared is not None and slot.dtype in (torch.int8, torch.uint8) and not own:
                    buffers[key] = shared[key]
                else:
                    buffers[key] = torch.empty(layout.shape(key), dtype=self.dtype, device=self.device)
        return buffers

    def buffer_pointers(self) -> list[int]:
        """data_ptr of every preallocated buffer (constant for the engine's lifetime)."""
        tensors = [t for s in self.slots for t in (s.host, s.device) if t is not None]
        tensors += [t for s in self.slots for t in s.buffers.values()]
        return list(dict.fromkeys(t.data_ptr() for t in tensors))

    # ------------------------------------------------------------------ streaming

    def _fill(self, slot: Slot, layer: int) -> int:
        """Bring ``layer`` into ``slot`` (runs on a reader thread when prefetching).

        On the CPU the slot ends with the layer's compute-dtype weights in ``slot.params``.
        """
        layout, ram = self.layouts[layer], self.ram[layer]
        if ram is not None and not self.cuda:
            # RAM-homed layers are used in place by the CPU: only a conversion, if any, is left to do.
            with self._after_read:  # built once (views of 14 tensors and packed objects: 0.1-0.3 ms a layer)
                params = self.ram_params.get(layer)
                if params is None:
                    params = self._to_compute(layout, ram, slot.buffers, self.ram_prepared[layer])
                    if self._pool is None and (kept := kept_for_reuse(params, slot.buffers)) is not None:  # inline
                        params = self.ram_params[layer] = kept
                slot.params = drop_dense(params)
            return 0
        started = time.perf_counter()
        size = layout.data_size
        offset = self._read_layer(layer, slot) if ram is None else 0
        source = slot.host if ram is None else ram
        assert source is not None
        with self._after_read:
            slot.offset = offset
            if self.cuda:
                assert self._copy_stream is not None and slot.device is not None and slot.free is not None
                with torch.cuda.stream(self._copy_stream):
                    # The slot may still feed kernels queued for the layer it held before.
                    self._copy_stream.wait_event(slot.free)
                    end = slot.offset + size
                    slot.device[:end].copy_(source[:end], non_blocking=True)
                self._copy_stream.synchronize()
            done = time.perf_counter()
            # Consecutive layers' reads overlap: the time the reader worked on this one counts once.
            self.stats.read_seconds += max(0.0, done - max(started, self._read_busy_until))
            self._read_busy_until = done
            self.stats.bytes_read += size
            self.stats.layers_read += 1
            if not self.cuda:
                data = source[slot.offset : slot.offset + size]
                slot.params = self._to_compute(layout, data, slot.buffers)
        return size

    def _read_layer(self, layer: int, slot: Slot) -> int:
        """Read a disk-homed layer into ``slot.host``, retrying transient failures with backoff."""
        assert slot.host is not None
        path = self.paths[layer]
        delay, attempt = READ_BACKOFF_S, 1
        while True:
            try:
                reading = {"direct": True, "drop_cache": self.drop_cache, "pool": self._io, "depth": self.read_depth}
                offset = read_into(path, self.layouts[layer], slot.host, **reading)
                # The first pass hashes every file as it arrives (on this reader thread, beside compute).
                self.store.check_read(path.name, read_pieces(self.layouts[layer], slot.host, offset))
                return offset
            except DamagedStoreError:
                if attempt > 1:
                    raise  # read twice, damaged twice: the bytes on disk are wrong, not the read
                log.warning("%s: its bytes do not match the manifest's checksum; reading it once more", path)
                attempt += 1
            except (OSError, StoreError) as exc:  # EIO, a short read of a file being rewritten...
                if attempt == READ_ATTEMPTS:
                    raise LayerReadError(
                        f"{path}: reading layer {layer} failed {READ_ATTEMPTS} times, last: {exc}"
                    ) from exc
                with self._after_read:
                    self.stats.read_retries += 1
                log.warning("%s: reading layer %d failed (%s); retry %d in %.2fs", path, layer, exc, attempt, delay)
                time.sleep(delay)
                delay, attempt = delay * 2, attempt + 1

    def _request(self, layer: int) -> Slot:
        slot = self.slots[self._next % len(self.slots)]
        self._next += 1
        slot.layer = layer
        if self._pool is None:
            slot.ready = None
            self._fill(slot, layer)
        else:
            slot.ready = self._pool.submit(self._fill, slot, layer)
        return slot

    def _acquire(self, layer: int) -> Params:
        """Wait for ``layer`` and return its weights as compute-dtype tensors on the compute device."""
        slot = self._current
        if slot.ready is not None:
            # Cleared before waiting: a failed read is raised once (this pass), not on every later one.
            ready, slot.ready = slot.ready, None
            started = time.perf_counter()
            ready.result()
            self.stats.wait_seconds += time.perf_counter() - started
        if not self.cuda:
            assert slot.params is not None
            params, slot.params = slot.params, None
            return params
        assert slot.device is not None
        layout = self.layouts[layer]
        return self._to_compute(layout, slot.device[slot.offset : slot.offset + layout.data_size], slot.buffers)

    def _to_compute(self, layout: FileLayout, data: Tensor, buffers: Params, prepared: Prepared = UNPREPARED) -> Params:
        """The layer's weights for compute: views of ``data``, packed matrices (the fused CPU path; int4 ones
        with ``prepared`` kernel codes, repacked for this CPU, where given; where the engine repacks and
        none are given, a streamed int4 matrix is dequantized here; int8 ones as ``prepared``, rotated in place)
        or conversions into ``buffers``."""
        (kernel_codes, rotated, copies), raw = prepared, layout.views(data)
        params: Params = {}
        for key, tensor in raw.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            shape = layout.shape(key)
            packed: PackedInt4 | PackedInt8 | None = None
            if tensor.dtype == torch.uint8:
                scales, codes, copy = raw[key + SCALE_SUFFIX], kernel_codes.get(key), copies.get(key)
                packed = PackedInt4(
                    tensor, scales, (shape[0], shape[1]), buffers[key], kernel_codes=codes, int8_copy=copy
                )
            elif tensor.dtype == torch.int8 and key in rotated:
                packed = rotated[key]  # views of these RAM bytes, prepared once
            elif tensor.dtype == torch.int8:
                packed = PackedInt8(tensor, raw[key + SCALE_SUFFIX], (shape[0], shape[1]), buffers[key])
            if packed is not None:
                by_reader = not self.fused or (isinstance(packed, PackedInt4) and self.widen_int4 and not kernel_codes)
                params[key] = packed.dense(self.dtype) if by_reader else packed
            elif tensor.dtype == self.dtype:
                params[key] = tensor
            else:
                params[key] = buffers[key].copy_(tensor)
        return params

    # ------------------------------------------------------------------ ForwardModel

    def new_cache(self, batch: int, max_len: int, pad: Tensor | None = None, task: Task | None = None) -> KVCache:
        """An empty cache on the KV home (``task``'s, if it plans one, else the engine's), in ``kv_dtype`` or else
        the compute dtype."""
        home = task.kv_home if task is not None else None
        device = self.kv_device if home is None else self.device if home == "device" else torch.device("cpu")
        kvd = self.kv_dtype
        dtype = resolve_dtype(kvd) if kvd and kvd not in QUANTIZED else self.dtype
        cache = KVCache.allocate(self.config, batch, max_len, dtype=dtype, device=device, pad=pad, kv_dtype=kvd)
        cache.attend_where_stored = ((task and task.attention_home) or self.attention_home) == "kv"
        return cache

    @torch.inference_mode()
    def forward(
        self,
        ids: Tensor,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        *,
        last_only: bool = False,
        select: Tensor | None = None,
        task: Task | None = None,
        on_layer: Callable[[], None] | None = None,
    ) -> Tensor:
        """Run ``ids [B, T]``; returns fp32 CPU logits (see ``ForwardModel.forward``). ``task``: its prefill
        micro-batch, else the engine's. ``on_layer`` after every layer of every micro-batch: the watchdog's unit
        of liveness (one pass of a big batch, a CPU-only prefill, can outlast batch.stall_timeout)."""
        started = time.perf_counter()
        cfg, fam = self.config, self.family
        B, T = ids.shape
        logits, self.last_hidden = forward_pass(  # the pre-head states: a stance head reads them
            ids,
            prepare_step(cfg, self.rope, cache, T, pad, self.device, self.dtype, batch=B),
            cache,
            embed=lambda ids: fam.embed(ids.to(self.embed_device), self.resident, cfg).to(self.device),
            layers=self._layers(trim=T > 1 and not self.cuda),  # a CPU prefill's freed temporaries go back
            head=lambda x: fam.head(x, self.resident, cfg),
            watch=self.watch,
            rows=B if T == 1 else (task and task.micro_batch) or self.micro_batch or B,
            last_only=last_only,
            select=select,
            on_layer=on_layer,
            num_layers=cfg.num_layers,
        )
        self.stats.forwards += 1
        self.stats.forward_seconds += (seconds := time.perf_counter() - started)
        hidden = 100 * self.stats.io_hidden_fraction
        stats = (self.stats.forwards, B, T, seconds, self.stats.read_bandwidth / 2**20, hidden)
        log.debug("forward %d: %dx%d tokens in %.2fs, %.0f MiB/s read, %.0f%% of I/O hidden", *stats)
        return logits

    def _layers(self, trim: bool) -> Iterator[tuple[str, LayerCall]]:
        """Every layer in order, each read while the one before computes; its slot is freed once it has run (and,
        with ``trim``, the heap's freed pages handed back: :func:`trim_heap`)."""
        cfg = self.config
        if self._prefetched is None or self._prefetched.layer != 0 or _failed(self._prefetched):
            self._drain()  # an earlier step stopped midway or its read failed: restart the stream at layer 0
            self._prefetched = self._request(0)
        for i in range(cfg.num_layers):
            self._current = self._prefetched
            # Read the next layer (layer 0 of the next step after the last one) while this one computes.
            self._prefetched = self._request((i + 1) % cfg.num_layers) if self._pool is not None else None
            params = self._acquire(i)
            yield f"layer {i} ({self.paths[i].name})", bind_layer(self.family, params, cfg, i)
            drop_dense(params)
            if trim:
                trim_heap()
            if self.cuda:
                assert self._current.free is not None
                # On the compute device's stream: a bare record() takes the current device's (cuda:0 under cuda:1).
                self._current.free.record(torch.cuda.current_stream(self.device))
            if self._pool is None and i + 1 < cfg.num_layers:
                self._prefetched = self._request(i + 1)

    __call__ = forward

    def first_nonfinite(self) -> str:
        """Where the last pass first went non-finite (:func:`robot_llm.llm.engine.finite.check_logits` asks)."""
        return self.watch.first_bad() or "the output head"

    def _drain(self) -> None:
        """Wait for every read in flight; their results are discarded (the stream restarts), errors too."""
        for slot in self.slots:
            ready, slot.ready = slot.ready, None
            if ready is not None:
                ready.exception()  # waits; the error, if any, belonged to a pass that already failed
            slot.params = None

    def close(self) -> None:
        """Finish the outstanding read and stop the reader threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        self._prefetched = None


def _failed(slot: Slot) -> bool:
    """The slot's read finished with an error (e.g. layer 0 prefetched at the end of a pass)."""
    return slot.ready is not None and slot.ready.done() and slot.ready.exception() is not None
