"""Our own kernels for a CPU decode step (``gemv.c`` and :data:`SOURCES`), compiled once per machine with the C
compiler and loaded with :mod:`ctypes`.

A decode step at batch 1 is a pass over every matrix, so it runs at the speed one core reads its codes; torch's
fused int8 kernel (``_weight_int8pack_mm``) reads Gemma 3 270M's 262,144 x 640 head at 5.9 GB/s on a Sapphire
Rapids core (28.6 ms, 1 thread). ``gemv.c`` widens the codes to fp32 in registers, multiplies fp32 activations and
reads the codes once for all of a call's rows (the head at one row: 16-20 ms). Its int8 x int8 product (AMX tiles,
AVX512-VNNI, over packed codes too with ``vnni.c``, or AVX2) serves the calls whose activations are quantized. It
also holds the RMSNorm with its rotary or residual add (``norm.c``), the attention of one new position
(``attend.c``), a decode step's layer of them in one call (``layer.c``) and the choice of the next tokens
(``sample.c``). Without a compiler, on a CPU without AVX2 and FMA, or with ``ROBOT_LLM_GEMV=0``,
:func:`gemv_available` is False and the callers keep torch's. It is cached under ``~/.cache/robot-llm/kernels``
(``XDG_CACHE_HOME``), named by a hash of the sources, the flags, the compiler and the CPU's features.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.llm.plan.cpu import cpu_flags, cpu_has_native_bf16

if TYPE_CHECKING:
    from torch import Tensor

    #: A matrix of an int8-activation product: its codes, fp32 scales, and packed codes' offsets (None: row-major).
    Int8Matrix = tuple[Tensor, Tensor, Tensor | None]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
#: Every file of the shared object: few-row products, many-row ones, norms, attention, gated MLP, layer, sampling.
SOURCES = tuple(
    SOURCE.with_name(f) for f in ("gemv.c", "vnni.c", "gemm.c", "norm.c", "attend.c", "gated.c", "layer.c", "sample.c")
)
HEADERS = (SOURCE.with_name("floats.h"), SOURCE.with_name("vectors.h"))
#: The dtype codes of ``floats.h``, by the dtype's name.
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}  # int8: a KV cache's codes
ENV = "ROBOT_LLM_GEMV"
#: The most matrices one rl_int8_linear call multiplies (gemv.c's MAX_MATRICES: q, k and v; gate and up), and the
#: rows of a group of packed codes (vnni.c's GROUP: packed codes are padded to a multiple of them).
MAX_MATRICES, VNNI_GROUP = 4, 16
#: The largest activation code where the AVX2 body multiplies, unless ``ROBOT_LLM_ACTIVATION_LEVELS`` says otherwise
#: (:func:`activation_levels`). 63 runs its narrow product (Sapphire Rapids as the AVX2 kind, 1 thread, ms at 32 rows:
#: the 262,144 x 640 head 112-114 -> 92, 2048 x 640 0.74 -> 0.57, 640 x 2048 0.69-0.72 -> 0.50-0.52; the head at 1
#: row is the memory's either way) but nearly doubles what the night's store costs the model: Gemma 3 270M's int4
#: store against its fp32 store (``benchmarks/int8_accuracy.py``, 8,192 tokens of financial news, fp32 compute), mean
#: KL 0.0095 weight-only, 0.0105 at 127 levels, 0.0190 at 63; top-1 agreement 92.0, 92.2, 89.6 %. So 127 by default.
AVX2_ACTIVATION_LEVELS, LEVELS_ENV = 127, "ROBOT_LLM_ACTIVATION_LEVELS"
#: Rows of a call (lowest, highest) that ``gemm.c``'s products serve, by the stored dtype, on a CPU without native
#: bf16 (:func:`matmul_available`), where torch feeds its fused int4 kernel bf16 activations it cannot compute and
#: past a few rows widens both dtypes into fp32 every pass; a streamed int4 matrix whose codes torch cannot read as
#: stored is served from one row. AVX2 EPYC, 1 thread, ms at 8 / 32 / 128 rows: int4 4096 x 1024 ours 2.3 / 5.1 / 24,
#: torch's fused kernel 3.0 / 10.5 / -, dequantized then fp32 19 / 25 / 55; int8 at 16 / 32 / 64 / 128 rows, 4096 x
#: 1024 ours 6.6 / 4.8 / 9.3 / 26, gemv.c 6.5 / 6.9 / 14 / 44, widened then fp32 14 / 20 / 34 / 38; the 262,144 x
#: 640 head at 16 / 32 / 64 rows 153-186 / 260-313 / 365-375, widened in blocks 164-256 / 257-451 / 554-750.
MATMUL_ROWS = {"int4": (8, 128), "int8": (11, 64)}
#: Rows up to which an int4 product is one pass over the codes (``gemm.c``'s ``rl_int4_gemv``; at most 8), and up
#: to which that pass also beats torch's fused int4 kernel with its casts where torch can read the codes (AVX2 EPYC,
#: 1 thread, 4096 x 1024, ms at 1 / 2 / 4 / 7 rows: 0.54 / 0.75 / 1.5 / 3.1 against 0.75 / 0.90 / 1.4 / 2.5).
INT4_GEMV_ROWS, INT4_FEW_ROWS = 7, 2
_INT, _INT64, _FLOAT, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def compile_flags() -> list[str]:
    """The compiler flags: this CPU's own instruction set (less the AMX tiles where they are hidden), or AVX2's
    where torch was told to stay on the AVX2 kind (``ATEN_CPU_CAPABILITY=avx2``, which the benchmarks use to
    measure that kind on a newer CPU)."""
    isa = ["-mavx2", "-mfma", "-mf16c"] if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" else ["-march=native"]
    tiles = {"amx_tile", "amx_int8"}
    if isa == ["-march=native"] and tiles <= cpu_flags("/proc/cpuinfo") and not tiles <= cpu_flags():
        isa += ["-mno-amx-tile", "-mno-amx-int8"]  # AMX hidden (HIDE_FLAGS_ENV): the VNNI body, as on a Zen 4
    return ["-O3", *isa, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def kernel_dir() -> Path:
    """Where compiled kernels are cached."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "robot-llm" / "kernels"


def build(flags: list[str] | None = None) -> Path:
    """Compile :data:`SOURCES` with ``flags`` (default :func:`compile_flags`) into :func:`kernel_dir`,
    unless that build is there already; the shared object's path. Raises ``RuntimeError`` (with the compiler's
    message)."""
    flags = compile_flags() if flags is None else flags
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    parts = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    parts += [" ".join(flags).encode(), compiler.encode(), *sorted(f.encode() for f in cpu_flags())]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = kernel_dir() / f"gemv-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so that two processes starting at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            names = " ".join(f.name for f in SOURCES)
            raise RuntimeError(f"{compiler} {' '.join(flags)} {names} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


class Kernels:
    """The shared object of :data:`SOURCES` loaded from ``path``."""

    def __init__(self, path: Path) -> None:
        import torch  # torch's libgomp is loaded first: the kernel shares torch's OpenMP runtime

        self.lib = ctypes.CDLL(str(path))
        int8 = [_PTR, _INT, *[_INT64] * 4, _PTR, _INT64, _PTR, _PTR, _INT, _INT64, _INT]
        int4 = [_PTR, _INT, *[_INT64] * 3, _PTR, _PTR, _INT64, _INT64, _PTR, _INT, _INT64, _INT]
        attend = [_PTR, _INT, *[_INT64] * 4, _PTR, _PTR, _INT, *[_INT64] * 3, _PTR, _PTR, *[_INT64] * 3]
        norm = [_PTR, _INT, _INT64, _INT64, _PTR, _INT, _FLOAT, _INT, _FLOAT]
        signatures: dict[str, tuple[list[Any], Any]] = {  # name: (argument types, result type)
            "rl_gemv_lanes": ([], _INT64),
            **{name: (int8, _INT) for name in ("rl_int8_gemv", "rl_int8_gemm")},
            **{name: (int4, _INT) for name in ("rl_int4_gemm", "rl_int4_gemv")},
            "rl_rms_norm": ([*norm, _PTR, _PTR, _INT64, _PTR, _PTR, _INT], _INT),
            "rl_decode_attention": ([*attend, _PTR, *[_INT64] * 3, _FLOAT, _FLOAT, _PTR, _INT], _INT),
            "rl_scale_int32": ([_PTR, _INT64, _INT64, _PTR, _PTR, _PTR, _INT, _INT], None),
            "rl_quantize_rows": ([_PTR, _INT, *[_INT64] * 4, _INT, _PTR, _PTR, _INT], _INT),
            "rl_argmax_rows": ([_PTR, _INT, _INT64, _INT64, _PTR, _INT], None),
            "rl_gated": ([_PTR, _PTR, _INT64, _INT, _INT, _PTR, _INT], None),
            "rl_decode_layer": ([_PTR], _INT),  # its one argument: decode_layer.py's Structure
            "rl_sample_rows": ([_PTR, _INT64, _INT64, _PTR, _INT64, *[_PTR] * 5, _INT], _INT),
            "rl_int8_mm": ([_PTR, _INT64, _INT64, _PTR, _INT64, _INT64, *[_PTR] * 4, _INT, _INT], _INT),
            "rl_vnni_pack": ([_PTR, *[_INT64] * 3, _PTR, _PTR], _INT),
            "rl_vnni_rows": ([_PTR, _INT64, _PTR, _INT64, _PTR], None),
            "rl_vnni_stream_bytes": ([_INT64], _INT64),
            "rl_int8_linear": ([_PTR, _INT, *[_INT64] * 4, _INT, _PTR, _INT, _INT, _INT], _INT),
            **{name: ([], _INT) for name in ("rl_int8_mm_body", "rl_amx_init", "rl_narrow_levels", "rl_vnni_max_rows")},
        }
        for name, (argtypes, restype) in signatures.items():
            getattr(self.lib, name).argtypes, getattr(self.lib, name).restype = argtypes, restype
        self.lib.rl_amx_init()  # the AMX tiles, where built and Linux grants them (else the VNNI body serves)
        #: The body of this build's int8 x int8 product (:meth:`int8_mm`): ``"amx"`` (AMX tiles), ``"vnni"``
        #: (AVX512-VNNI, a decode step's few rows) or ``"avx2"`` (every call: torch's int8 GEMM is no match
        #: without VNNI).
        self.int8_mm_body = {3: "amx", 2: "vnni"}.get(self.lib.rl_int8_mm_body(), "avx2")
        #: The largest code :meth:`quantize_rows` gives an activation, which :meth:`int8_mm` assumes; from
        #: :attr:`narrow_levels` down (the AVX2 body's) the product takes fewer instructions.
        self.activation_levels, self.narrow_levels = activation_levels(self.int8_mm_body), self.lib.rl_narrow_levels()
        self.dtype_codes = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}
        #: The input columns one vector holds: 16 (AVX512) or 8 (AVX2).
        self.lanes = int(self.lib.rl_gemv_lanes())

    def int8_gemv(self, x: Tensor, q: Tensor, scale: Tensor, n: int, rotation: int = 0) -> Tensor:
        """``x @ (q * scale[:, None]).T`` for a few rows: ``x [..., K]`` (zero-padded to ``q``'s width ``Kp``;
        with ``rotation``, each run of that many columns Hadamard-rotated first, as
        :func:`~robot_llm.llm.store.int8act.rotate` does), ``q int8 [N', Kp]`` (rows contiguous; the first ``n``
        used), ``scale bf16 [N']``; ``[..., n]`` in ``x``'s dtype (computed in fp32 for any float dtype)."""
        return self._int8_product(self.lib.rl_int8_gemv, x, q, scale, n, rotation)

    def int8_matmul(self, x: Tensor, q: Tensor, scale: Tensor, n: int, rotation: int = 0) -> Tensor:
        """:meth:`int8_gemv`'s product for many rows (``gemm.c``: each weight widened once per call)."""
        return self._int8_product(self.lib.rl_int8_gemm, x, q, scale, n, rotation)

    def _int8_product(self, fn: Any, x: Tensor, q: Tensor, scale: Tensor, n: int, rotation: int) -> Tensor:
        import torch

        kp = q.shape[1]
        if q.stride(1) != 1 or kp % self.lanes or scale.dtype != torch.bfloat16 or not scale.is_contiguous():
            raise ValueError(
                f"int8 products need row-contiguous int8 codes {self.lanes}-column aligned and contiguous bf16 "
                f"scales, got codes {tuple(q.shape)} strides {q.stride()} and {scale.dtype} scales"
            )
        if rotation and kp % rotation:
            raise ValueError(f"int8 products: a rotation block of {rotation} does not divide the width {kp}")
        rows, bf16 = self._rows(x)
        m, kx = rows.shape
        y = torch.empty(m, n, dtype=rows.dtype)
        args = (rows.data_ptr(), bf16, m, kx, kp, rotation, q.data_ptr(), q.stride(0), scale.data_ptr())
        if fn(*args, y.data_ptr(), bf16, n, torch.get_num_threads()) != 0:
            raise MemoryError(f"int8 product: no memory to stage {m} x {kp} activations")
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def int4_matmul(self, x: Tensor, codes: Tensor, scales_and_zeros: Tensor, n: int) -> Tensor:
        """``x @ W.T`` over an int4 matrix as stored (``codes uint8 [Np, Kp / 2]``, bf16 ``scales_and_zeros
        [Kp / group, Np, 2]``, :func:`~robot_llm.llm.store.quant.quantize_int4`'s layout; the first ``n`` rows
        used): ``x [..., K]`` zero-padded to ``Kp``; ``[..., n]`` in ``x``'s dtype, computed in fp32 over exactly
        :func:`~robot_llm.llm.store.quant.dequantize_int4_into`'s fp32 weights (``gemm.c``'s many-row product; up
        to :data:`INT4_GEMV_ROWS` rows its one pass over the codes, each group's sum scaled once)."""
        import torch

        np_, kp, groups, sz = codes.shape[0], 2 * codes.shape[1], scales_and_zeros.shape[0], scales_and_zeros
        aligned = codes.is_contiguous() and np_ % 64 == 0 and kp % groups == 0
        if not aligned or sz.dtype != torch.bfloat16 or not sz.is_contiguous() or sz.shape[1:] != (np_, 2):
            raise ValueError(
                f"int4_matmul needs contiguous codes of 64-row blocks and bf16 scales and zeros [groups, Np, 2], "
                f"got codes {tuple(codes.shape)} and {sz.dtype} {tuple(sz.shape)}"
            )
        rows, bf16 = self._rows(x)
        m, kx = rows.shape
        y = torch.empty(m, n, dtype=rows.dtype)
        fn = self.lib.rl_int4_gemv if m <= INT4_GEMV_ROWS else self.lib.rl_int4_gemm
        args = (rows.data_ptr(), bf16, m, kx, kp, codes.data_ptr(), scales_and_zeros.data_ptr(), np_, kp // groups)
        if fn(*args, y.data_ptr(), bf16, n, torch.get_num_threads()) != 0:
            raise MemoryError(f"int4_matmul: no memory to stage {m} x {kp} activations")
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def reads(self, codes: Tensor, offset: Tensor | None) -> bool:
        """Whether this build's int8 product reads ``codes``: row-major (``offset`` None), or packed in VNNI order with
        their int32 ``offset`` (:func:`~robot_llm.llm.store.int8act.vnni_pack`), which needs a VNNI build and the
        rows padded to a multiple of :data:`VNNI_GROUP`."""
        import torch

        if offset is None:
            return True
        rows = -(-offset.numel() // VNNI_GROUP) * VNNI_GROUP
        return self.int8_mm_body == "vnni" and offset.dtype is torch.int32 and codes.shape[0] >= rows

    @staticmethod
    def _rows(x: Tensor) -> tuple[Tensor, bool]:
        """``x`` as contiguous fp32 or bf16 rows ``[M, K]``, and whether they are bf16."""
        import torch

        rows = x.reshape(-1, x.shape[-1])
        rows = (rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()).contiguous()
        return rows, rows.dtype == torch.bfloat16

    def decode_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        scale: float,
        softcap: float | None = None,
        scales: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """``attend.c``'s attention of one new position per row: ``q [B, 1, n, hd]`` (contiguous, fp32 or bf16)
        over ``k``/``v`` ``[B, S, kv, hd]`` (same strides, the last 1; fp32 or bf16, or int8 codes with their fp16
        ``scales [B, S, kv, 1]`` for keys and values, alike in strides; read in place), ``mask [B, 1, 1, S]`` bool
        (True where forbidden; any strides); query head ``j`` uses KV head ``j // (n / kv)``. Returns
        ``[B, 1, n * hd]`` in q's dtype."""
        import torch

        B, _, n, hd = q.shape
        S, kv = k.shape[1], k.shape[2]
        out = torch.empty(B, 1, n * hd, dtype=q.dtype)
        codes = self.dtype_codes
        sb, ss, sh, _ = k.stride()
        ks, vs = (None, None) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
        strides = (0, 0, 0) if scales is None else scales[0].stride()[:3]
        failed = self.lib.rl_decode_attention(
            q.data_ptr(), codes[q.dtype], B, n, kv, hd, k.data_ptr(), v.data_ptr(), codes[k.dtype], sb, ss, sh,
            ks, vs, *strides, mask.data_ptr(), mask.stride(0), mask.stride(3), S, scale, softcap or 0.0,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"decode_attention: no memory for the scores of {S} keys")
        return out

    def int8_mm(
        self,
        a: Tensor,
        codes: Tensor,
        out: Tensor | None = None,
        scale: Tensor | None = None,
        row_scale: Tensor | None = None,
        offset: Tensor | None = None,
    ) -> Tensor:
        """``a int8 [M, Kp] @ codes int8 [N, Kp].T`` as int32 ``[M, N]`` (into ``out`` when given), exactly
        ``torch._int_mm(a, codes.t())`` for activation codes within :attr:`activation_levels` (as quantized here); with
        ``scale fp32 [N]`` and ``row_scale fp32 [M, 1]``, fp32 ``[M, N]`` as ``product.float().mul_(scale)
        .mul_(row_scale)`` computes it, in the same pass (:meth:`scale_int32`'s values, without the int32 matrix).
        ``offset int32 [N]``: the codes are packed in VNNI order (:meth:`reads`)."""
        import torch

        (m, k), n = a.shape, codes.shape[0] if offset is None else offset.numel()
        aligned = codes.stride(1) == 1 and codes.shape[1] == k and k % 64 == 0 and a.is_contiguous()
        if not (aligned and self.reads(codes, offset)):
            raise ValueError(
                f"int8_mm needs contiguous int8 rows and row-contiguous codes of one width, a multiple of 64 (packed: "
                f"a VNNI build's, rows to a multiple of 16); got {tuple(a.shape)} and codes {tuple(codes.shape)} "
                f"strides {codes.stride()}{'' if offset is None else f', {offset.numel()} {offset.dtype} offsets'}"
            )
        scaled = scale is not None
        if scaled != (row_scale is not None):
            raise ValueError("int8_mm: give both scales (the weight's and the rows') or neither")
        dtype = torch.float32 if scaled else torch.int32
        out = torch.empty(m, n, dtype=dtype) if out is None else out
        if out.shape != (m, n) or not out.is_contiguous() or out.dtype != dtype:
            got = f"{out.dtype} {tuple(out.shape)}"
            raise ValueError(f"int8_mm: the output must be contiguous {dtype} {(m, n)}, got {got}")
        if scaled:
            scale, row_scale = scale.float().contiguous(), row_scale.float().contiguous()
            if scale.numel() != n or row_scale.numel() != m:
                raise ValueError(f"int8_mm: {scale.numel()} and {row_scale.numel()} scales for {(m, n)} products")
        failed = self.lib.rl_int8_mm(
            a.data_ptr(), m, k, codes.data_ptr(), codes.stride(0), n, out.data_ptr(),
            scale.data_ptr() if scaled else None, row_scale.data_ptr() if scaled else None,
            None if offset is None else offset.data_ptr(), self.activation_levels, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"int8_mm: no memory for the buffers of {m} x {k} activations")
        return out

    def int8_linears(self, x: Tensor, matrices: tuple[Int8Matrix, ...], rotation: int = 0) -> list[Tensor]:
        """``x [..., K] @ (codes int8 [N, Kp] * scale fp32 [N, 1]).T`` for each ``(codes, scale, offset)`` of
        ``matrices`` (at most 4, one width, :func:`int8_products`) with int8 activations in one call: the rows quantized
        once as :meth:`quantize_rows` (padded, rotated by ``rotation``), multiplied and scaled as :meth:`int8_mm`, each
        rounded to ``x``'s dtype: :func:`~robot_llm.llm.store.int8act.int8_dynamic_linear`'s values without its torch
        glue (~130 products a decode step), the threads woken once."""
        import torch

        rows, bf16 = (x, x.dtype is torch.bfloat16) if plain_rows(x) else self._rows(x)
        k, kp, args = x.shape[-1], matrices[0][0].shape[1], int8_products(x.shape[-1], matrices, rotation)
        ys = [torch.empty((*x.shape[:-1], n), dtype=rows.dtype) for n in args[2::6]]
        args[4::6] = [y.data_ptr() for y in ys]
        m, each = rows.numel() // k, (ctypes.c_int64 * len(args))(*args)
        head = (rows.data_ptr(), bf16, m, k, kp, rotation, self.activation_levels)
        if self.lib.rl_int8_linear(*head, each, len(matrices), bf16, torch.get_num_threads()):
            raise MemoryError(f"int8_linear: no memory for the buffers of {m} x {kp} activations")
        return ys if rows.dtype is x.dtype else [y.to(x.dtype) for y in ys]

    def quantize_rows(self, x: Tensor, width: int, rotation: int = 0) -> tuple[Tensor, Tensor]:
        """:func:`~robot_llm.llm.store.int8act.quantize_activations`'s codes (to :attr:`activation_levels`) ``int8
        [M, width]`` and scales ``fp32 [M, 1]`` of the rows of ``x [..., K]`` (fp32 or bf16), the same values in one
        pass over each row; a row holding a NaN or an infinity gets a NaN scale. ``rotation``: each row zero-padded
        to ``width`` and every run of that many columns Hadamard-rotated in fp32 first (the fast transform of
        :func:`~robot_llm.llm.store.int8act.rotate`'s matrix), as a rotated matrix multiplies it."""
        import torch

        rows, bf16 = self._rows(x)
        m, k = rows.shape
        if width < k or (rotation and (width % rotation or rotation & (rotation - 1))):
            raise ValueError(f"quantize_rows: {k} columns, rotation {rotation}, do not fit a width of {width}")
        q, scale = torch.empty(m, width, dtype=torch.int8), torch.empty(m, 1, dtype=torch.float32)
        args = (rows.data_ptr(), bf16, m, k, width, rotation, self.activation_levels, q.data_ptr(), scale.data_ptr())
        if self.lib.rl_quantize_rows(*args, torch.get_num_threads()):
            raise MemoryError(f"quantize_rows: no memory for a row of {width}")
        return q, scale

    def argmax_rows(self, x: Tensor) -> Tensor:
        """``x.argmax(-1)`` of fp32 or bf16 rows ``x [..., n]`` as int64 ``[...]``: the first largest value's
        column (the first NaN's where a row holds one), in one pass over each row."""
        import torch

        rows, bf16 = self._rows(x)
        idx = torch.empty(rows.shape[0], dtype=torch.int64)
        self.lib.rl_argmax_rows(rows.data_ptr(), bf16, *rows.shape, idx.data_ptr(), torch.get_num_threads())
        return idx.view(x.shape[:-1])

    def gated(self, gate: Tensor, up: Tensor, kind: int) -> Tensor:
        """``gated.c``'s ``act(gate) * up`` over contiguous fp32 or bf16 tensors of one shape and dtype (``kind``: the
        activation's code, :data:`~robot_llm.llm.families.gated.ACTIVATIONS`): a new tensor."""
        import torch

        out = torch.empty_like(gate)
        bf16, threads = gate.dtype is torch.bfloat16, torch.get_num_threads()
        self.lib.rl_gated(gate.data_ptr(), up.data_ptr(), gate.numel(), kind, bf16, out.data_ptr(), threads)
        return out

    def scale_int32(self, acc: Tensor, scale: Tensor, row_scale: Tensor, bf16: bool = False) -> Tensor:
        """An int8 x int8 product's fp32 values (rounded to bf16 with ``bf16``), in one pass: ``acc int32 [M, N]``
        (contiguous) times ``scale fp32 [N]`` and ``row_scale fp32 [M, 1]``, as ``acc.float().mul_(scale).mul_(
        row_scale)`` (then ``.bfloat16()``) computes them."""
        import torch

        m, n = acc.shape
        scale, row_scale = scale.float().contiguous(), row_scale.float().contiguous()
        if not acc.is_contiguous() or scale.numel() != n or row_scale.numel() != m:
            sizes = f"{scale.numel()} and {row_scale.numel()} scales"
            raise ValueError(f"scale_int32: {tuple(acc.shape)} products (contiguous?) by {sizes}")
        out = torch.empty(m, n, dtype=torch.bfloat16 if bf16 else torch.float32)
        args = (acc.data_ptr(), m, n, scale.data_ptr(), row_scale.data_ptr(), out.data_ptr())
        self.lib.rl_scale_int32(*args, bf16, torch.get_num_threads())
        return out

    def rms_norm(
        self,
        x: Tensor,
        weight: Tensor | None,
        eps: float,
        *,
        offset: float = 0.0,
        gain_rounded: bool = False,
        rotary: tuple[Tensor, Tensor] | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """``norm.c``'s RMSNorm of ``x [..., n]`` (contiguous fp32 or bf16; see
        :func:`~robot_llm.llm.families.norm.rms_norm` for the arithmetic), then the rotary ``(cos, sin)``
        (each ``[rows / heads, n]`` as many elements, x's dtype) and the ``residual`` add; ``weight`` None: no
        norm. A new tensor of x's shape and dtype."""
        import torch

        n = x.shape[-1]
        out = torch.empty_like(x)
        cos, sin = rotary if rotary is not None else (None, None)
        heads = x.numel() // cos.numel() if cos is not None else 1
        codes, w_dtype = self.dtype_codes, 0 if weight is None else self.dtype_codes[weight.dtype]
        failed = self.lib.rl_rms_norm(
            x.data_ptr(), codes[x.dtype], x.numel() // n, n,
            None if weight is None else weight.data_ptr(), w_dtype, offset, gain_rounded, eps,
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), heads,
            None if residual is None else residual.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"rms_norm: no memory for a row of {n}")
        return out


def int8_products(k: int, matrices: tuple[Int8Matrix, ...], rotation: int) -> list[int]:
    """``rl_int8_linear``'s six int64 for each ``(codes, scale, offset)`` of ``matrices`` meeting ``k`` columns (its
    output's address 0: the caller's; ``offset`` int32 where the codes are packed, ``vnni.c``, else None);
    ``ValueError`` past :data:`MAX_MATRICES` or for codes, scales or offsets it cannot read."""
    import torch

    if len(matrices) > MAX_MATRICES:
        raise ValueError(f"int8_linears: {len(matrices)} matrices, at most {MAX_MATRICES} in one call")
    kp, args, lib = matrices[0][0].shape[1], [], kernels()
    rotates = not rotation or (kp % rotation == 0 and rotation & (rotation - 1) == 0)
    for codes, scale, offset in matrices:
        n = codes.shape[0] if offset is None else offset.numel()
        aligned = codes.stride(1) == 1 and codes.shape[1] == kp and kp % 64 == 0 and kp >= k
        fits = scale.dtype is torch.float32 and scale.numel() == n and scale.is_contiguous()
        if not (aligned and rotates and fits and (offset is None or (lib is not None and lib.reads(codes, offset)))):
            raise ValueError(
                f"int8_linear: {k} columns, rotation {rotation}, against codes {tuple(codes.shape)} strides "
                f"{codes.stride()} (a width of 64s; packed: a VNNI build's, rows to 16s) and {scale.dtype} scales "
                f"{tuple(scale.shape)} (fp32, one a row)"
            )
        args += [codes.data_ptr(), codes.stride(0), n, scale.data_ptr(), 0, 0 if offset is None else offset.data_ptr()]
    return args


def plain_rows(x: Tensor) -> bool:
    """Whether our kernels read ``x`` as it is: contiguous fp32 or bf16 on the CPU (asked ~250 times a step)."""
    import torch

    return x.is_cpu and (x.dtype is torch.bfloat16 or x.dtype is torch.float32) and x.is_contiguous()


def activation_levels(body: str) -> int:
    """The largest code our kernels quantize an activation to where ``body`` (:attr:`Kernels.int8_mm_body`)
    multiplies: 127 on VNNI and AMX (exact for every code at one cost); on AVX2 ``ROBOT_LLM_ACTIVATION_LEVELS``
    (1-127) or :data:`AVX2_ACTIVATION_LEVELS`. Raises ``ValueError`` naming the variable for any other value."""
    asked = os.environ.get(LEVELS_ENV, "").strip()
    if body != "avx2" or not asked:
        return 127 if body != "avx2" else AVX2_ACTIVATION_LEVELS
    if not asked.isdigit() or not 1 <= int(asked) <= 127:
        raise ValueError(f"{LEVELS_ENV}={asked!r}: give a whole number of activation levels from 1 to 127")
    return int(asked)


@functools.cache
def kernels() -> Kernels | None:
    """This process's ``gemv.c`` (built on first use), or None: turned off (``ROBOT_LLM_GEMV=0``), a CPU
    without AVX2 and FMA, or no compiler (then a warning says so once)."""
    if os.environ.get(ENV, "auto").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    try:
        return Kernels(build())
    except (OSError, RuntimeError) as exc:
        log.warning("%s not built (%s): int8 decode products use torch's kernels", SOURCE.name, exc)
        return None


def matmul_available() -> bool:
    """True when ``gemm.c``'s many-row products serve this process: built, on a CPU without native bf16 (with
    it, torch's bf16 kernels and int8 activations serve those calls)."""
    return kernels() is not None and not cpu_has_native_bf16()


def matmul_serves(dtype: str, rows: int, torch_reads: bool = True) -> bool:
    """True when a call of ``rows`` rows over a ``dtype`` (``"int4"``/``"int8"``) matrix goes through ``gemm.c``
    (:data:`MATMUL_ROWS`; an int4 one's calls of up to :data:`INT4_FEW_ROWS` rows too); ``torch_reads`` False:
    torch's fused kernel cannot read the int4 matrix's codes as given, so ours serves all its few-row calls."""
    low, high = MATMUL_ROWS[dtype]
    few = dtype == "int4" and (rows <= INT4_FEW_ROWS or not torch_reads)
    return matmul_available() and rows <= high and (rows >= low or few)


def gemv_available() -> bool:
    """True when ``gemv.c`` is built and loaded for this process."""
    return kernels() is not None
