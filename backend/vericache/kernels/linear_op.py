"""The batch-invariant linear op (``linear.cpp``) built per instruction set and called through ctypes.

``linear.cpp`` has no torch headers, so g++ builds each variant in seconds (``build.py``): ``amx`` (AMX tile
multiplies for the q8 numerics' many-row calls), ``avx512vnni`` (the
next one plus ``-mavx512vnni``: the q8 numerics' integer dots in VNNI's ``dpbusd``), ``avx512``
(``-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c``), ``avx2`` (``-mavx2 -mfma -mf16c``, no
AVX-512 flag: what an AMD EPYC without AVX-512 runs) and ``portable`` (baseline x86-64, scalar). All
give the same bits (the op's lane structure is fixed); ``cpu.best_isa()`` picks the widest one this
CPU's flags allow, ``LinearOp(isa)`` loads one. The library links the process's libgomp (torch's), so
the op and torch share one OpenMP thread pool and ``torch.set_num_threads`` governs both.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vericache.kernels.build import Library, load_cached
from vericache.kernels.cpu import ISA_FLAGS, best_isa, supported_isas
from vericache.kernels.layouts import BLOCK, FORMATS

HERE = Path(__file__).parent
SOURCES = [HERE / "linear.cpp", HERE / "linear_q8.cpp"]
HEADERS = [HERE / "gguf_blocks.h"]
# exact, reproducible IEEE arithmetic: explicit fma only, no contraction, no reassociation
CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]

# formats with integer codes: the q8 numerics' integer dot products (``LinearOp.q8``); F32/F16/BF16
# weights run the fp32 op in either numerics
Q8_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The model's arithmetic, one name for the whole forward: "q8" (int8 activations in integer dots with the
# stored codes), "q8qk" (q8's linears, and attention scores as int8 query . int8 key integer dots:
# ``kernels/int_scores.h``), "fp32" (exact dequantization, fp32 attention)
NUMERICS = ("q8", "q8qk", "fp32")
# score units of ``kernels/int_scores.h`` by the kernels' ISA: the same bits on each (0: fp32 scores)
_SCORE_UNIT = {"amx": 3, "avx512vnni": 2}


def default_numerics(integer_blocks: bool) -> str:
    """The CPU's numerics where none is asked for: for a model stored in integer blocks (a GGUF file) the
    integer numerics, else fp32 (a float checkpoint: exact dequantization of nothing)."""
    return "q8qk" if integer_blocks else "fp32"


def linear_numerics(numerics: str) -> str:
    """The linears' part of a model's numerics: "q8" or "fp32"."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    return "fp32" if numerics == "fp32" else "q8"


def score_unit(numerics: str, isa: str) -> int:
    """The attention op's ``score_unit`` for a model's numerics on an ``isa`` build: 0 (fp32 scores) unless
    "q8qk", then the integer dots' fastest unit there (3 AMX, 2 VNNI, 1 the build's own vector code)."""
    return _SCORE_UNIT.get(isa, 1) if numerics == "q8qk" else 0


def linear_library(isa: str) -> Library:
    """The op's library for ``isa``: plain C (no torch headers: g++ builds it in seconds)."""
    return Library(f"linear-{isa}", tuple(SOURCES + HEADERS), (*CFLAGS, *ISA_FLAGS[isa]), ("-fopenmp",))


def _build(isa: str, verbose: bool = False) -> Path:
    """The op's library for ``isa``: the package's (``prebuilt``), else built here once into the kernel cache."""
    from vericache.kernels.prebuilt import prebuilt_file

    packaged = prebuilt_file("linear", isa)
    if packaged is not None:
        return packaged
    return load_cached(linear_library(isa), lambda path: path, verbose)


@dataclass(frozen=True)
class StoredWeight:
    """A weight matrix [n, k] as stored: ``data`` uint8 [n, row_bytes] blocks of ``fmt`` (a GGUF type
    name), or for F32/F16/BF16 the [n, k] tensor itself. ``panels``: the same codes laid out for the q8
    op's many-row path (``LinearOp.pack``), or None: those calls decode the blocks each time."""
    fmt: str
    data: torch.Tensor
    n: int
    k: int
    panels: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}; supported: {', '.join(FORMATS)}")
        size, elems = BLOCK[self.fmt]
        if self.k % elems:
            raise ValueError(f"{self.fmt} rows need k divisible by {elems}, got k={self.k}")
        if self.data.shape[0] != self.n or self.data.nbytes != self.n * self.row_bytes:
            raise ValueError(f"{self.fmt} weight [{self.n}, {self.k}] needs {self.n} rows of {self.row_bytes} "
                             f"bytes, got {tuple(self.data.shape)} {self.data.dtype}")
        if not self.data.is_contiguous():
            raise ValueError("stored weight data must be contiguous")
        if self.panels is not None and (self.panels.dtype != torch.uint8 or self.panels.dim() != 1
                                        or not self.panels.is_contiguous()):
            raise ValueError("a weight's panels are one contiguous uint8 tensor (LinearOp.pack)")

    @property
    def row_bytes(self) -> int:
        size, elems = BLOCK[self.fmt]
        return self.k // elems * size

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @classmethod
    def from_tensor(cls, w: torch.Tensor) -> StoredWeight:
        """A dense fp32/fp16/bf16 [n, k] tensor as it is (no copy when contiguous)."""
        fmt = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(w.dtype)
        if fmt is None or w.dim() != 2:
            raise TypeError(f"a dense weight must be a 2-D fp32/fp16/bf16 tensor, got {w.dtype} {tuple(w.shape)}")
        return cls(fmt, w.detach().contiguous(), w.shape[0], w.shape[1])

    @classmethod
    def q8_0(cls, w: torch.Tensor) -> StoredWeight:
        """A dense [n, k] weight as GGUF Q8_0 blocks (the ``gguf`` package's rounding): what a float
        checkpoint's linears read in the q8 numerics."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        if w.dim() != 2 or w.shape[1] % 32:
            raise ValueError(f"Q8_0 needs a 2-D weight with k divisible by 32, got {tuple(w.shape)}")
        raw = quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
        return cls("Q8_0", torch.from_numpy(raw.reshape(w.shape[0], -1)).contiguous(), w.shape[0], w.shape[1])

    @staticmethod
    def cat(parts: list[StoredWeight]) -> StoredWeight:
        """Rows of several weights of one format and width, stacked (the fused q/k/v and gate/up)."""
        fmts, ks = {p.fmt for p in parts}, {p.k for p in parts}
        if len(fmts) != 1 or len(ks) != 1:
            raise ValueError(f"cannot stack weights of formats {sorted(fmts)} and widths {sorted(ks)}")
        return StoredWeight(parts[0].fmt, torch.cat([p.data for p in parts]), sum(p.n for p in parts), parts[0].k)


class LinearOp:
    """One loaded variant of the op: ``op(x, weight, bias)`` and ``op.dequantize(weight, rows)``."""

    def __init__(self, isa: str | None = None, verbose: bool = False) -> None:
        self.isa = isa or best_isa()
        if self.isa not in ISA_FLAGS:
            raise ValueError(f"unknown ISA {self.isa!r}; choose one of {', '.join(ISA_FLAGS)}")
        if self.isa == "amx" and "amx" not in supported_isas():
            raise RuntimeError("this CPU or kernel gives no AMX tiles to this process (arch_prctl refused): "
                               "use the avx512vnni build")
        self.lib = ctypes.CDLL(str(_build(self.isa, verbose)))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.lib.vc_linear.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
        self.lib.vc_linear_q8.argtypes = self.lib.vc_linear.argtypes
        self.lib.vc_linear_q8_packed.argtypes = [ctypes.c_int, ptr, ptr, *self.lib.vc_linear.argtypes[2:]]
        self.lib.vc_q8_panel_bytes.argtypes = [ctypes.c_int, i64, i64]
        self.lib.vc_q8_panel_bytes.restype = i64
        self.lib.vc_q8_pack.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self.lib.vc_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
        self.lib.vc_linear_isa.restype = ctypes.c_char_p
        assert self.lib.vc_linear_isa().decode() == self.isa

    def __call__(self, x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
        """x: [M, k] fp32 -> [M, n] fp32, exact and batch-invariant (other float dtypes are computed in
        fp32 and cast back)."""
        return self._run(functools.partial(self.lib.vc_linear, FORMATS[weight.fmt], weight.data.data_ptr()),
                         x, weight, bias, threads)

    def q8(self, x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
        """The q8 numerics (``linear_q8.cpp``): int8 activations per block of 32 in integer dot
        products with the stored codes, combined in one fixed fp32 order: batch-invariant and the same
        bits in every build, as ``__call__`` is; F32/F16/BF16 weights run ``__call__``."""
        if weight.fmt not in Q8_FORMATS:
            return self(x, weight, bias, threads)
        if weight.panels is not None and weight.panels.numel() != self.panel_bytes(weight) > 0:
            raise ValueError(f"{weight.fmt} [{weight.n}, {weight.k}]: its panels are not this {self.isa} build's "
                             f"layout ({weight.panels.numel()} bytes, not {self.panel_bytes(weight)}): pack it "
                             "with this op (LinearOp.pack)")
        return self._run(functools.partial(self.lib.vc_linear_q8_packed, FORMATS[weight.fmt], weight.data.data_ptr(),
                                           None if weight.panels is None else weight.panels.data_ptr()),
                         x, weight, bias, threads)

    def pack(self, weight: StoredWeight, threads: int | None = None) -> StoredWeight:
        """``weight`` with its panels for the q8 op (uint8, ~0.7-1.3 bytes a code, the build's layout): rows of verification,
        prefill and batches then read them instead of decoding every block in each call, the same bits.
        Unchanged where this build reads blocks directly (portable) or the format has no integer codes."""
        size = self.panel_bytes(weight)
        if size <= 0:
            return weight
        panels = torch.empty(size, dtype=torch.uint8)
        rc = self.lib.vc_q8_pack(FORMATS[weight.fmt], weight.data.data_ptr(), weight.row_bytes, weight.n, weight.k,
                                 panels.data_ptr(), threads or torch.get_num_threads())
        if rc:
            raise ValueError(f"cannot pack {weight.fmt} [{weight.n}, {weight.k}]")
        return replace(weight, panels=panels)

    def panel_bytes(self, weight: StoredWeight) -> int:
        """Bytes of ``weight``'s panels in this build's layout (0: the build reads none, the portable one's
        scalar loop reads the blocks). A build reads only its own layout: the VNNI build packs codes of up
        to 6 bits and keeps the blocks' fp16 scales, so its panels differ from the others' for every format,
        in size too (which is how a mismatch is caught)."""
        if weight.fmt not in Q8_FORMATS:
            return 0
        return max(0, self.lib.vc_q8_panel_bytes(FORMATS[weight.fmt], weight.n, weight.k))

    def numerics(self, name: str):
        """The op of a model's numerics ``name`` (``NUMERICS``): ``q8`` for q8 and q8qk, else this one (``__call__``)."""
        return self.q8 if linear_numerics(name) == "q8" else self

    def _run(self, fn, x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None,
             threads: int | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != weight.k:
            raise ValueError(f"x must be [M, {weight.k}], got {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"the linear op runs on CPU tensors, got {x.device}")
        dtype = x.dtype
        xf = x.float()
        if weight.k % 16 or xf.stride(1) != 1:   # the op reads whole 16-lane steps of each row
            pad = -weight.k % 16
            xf = torch.nn.functional.pad(xf, (0, pad)) if pad else xf.contiguous()
        if bias is not None:
            bias = bias.detach().float().contiguous()
            if bias.shape != (weight.n,):
                raise ValueError(f"bias must be [{weight.n}], got {tuple(bias.shape)}")
        y = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
        rc = fn(weight.row_bytes, weight.n, weight.k,
                xf.data_ptr(), xf.stride(0), x.shape[0], bias.data_ptr() if bias is not None else None,
                y.data_ptr(), weight.n, threads or torch.get_num_threads())
        if rc:
            raise ValueError(f"linear op refused {weight.fmt} [{weight.n}, {weight.k}] x {tuple(x.shape)}")
        return y if dtype == torch.float32 else y.to(dtype)

    def dequantize(self, weight: StoredWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the weight (all when ``rows`` is None) as fp32 [len(rows), k]: embedding lookups."""
        idx = torch.arange(weight.n) if rows is None else rows.to(torch.int64).reshape(-1).contiguous()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= weight.n):
            raise ValueError(f"row index out of range [0, {weight.n}): {idx.min().item()}..{idx.max().item()}")
        out = torch.empty(idx.numel(), weight.k, dtype=torch.float32)
        rc = self.lib.vc_dequant_rows(FORMATS[weight.fmt], weight.data.data_ptr(), weight.row_bytes, weight.k,
                                      idx.data_ptr(), idx.numel(), out.data_ptr())
        if rc:
            raise ValueError(f"cannot dequantize {weight.fmt} rows of width {weight.k}")
        return out


@functools.cache
def linear_op(isa: str | None = None) -> LinearOp:
    """The op for ``isa`` (default ``best_isa()``), built once per machine and loaded once per process."""
    return LinearOp(isa or best_isa())
