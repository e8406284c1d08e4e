"""KV quantization methods: each one only says how K and V are stored (``layouts``).

The layouts (``vericache.kv.quantized``) carry the encode, the reference dequantization and the
attention kernel's format, so the bytes a cache reports are the bytes it holds and the bytes the
draft attention reads: nothing is kept dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.base import QuantCompressor
from vericache.kernels.layouts import CHANNEL_GROUPS, TOKEN_GROUPS
from vericache.kernels.layouts import FP8 as FP8_KIND
from vericache.kv.quantized import Layout


def _check_bits(name: str, bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"{name}: bits must be one of {allowed}, got {bits!r}")


def _check_group(name: str, group: int) -> None:
    if not isinstance(group, int) or group < 8 or group & (group - 1):
        raise ValueError(f"{name}: group must be a power of two >= 8, got {group!r}")


@dataclass
class KIVI(QuantCompressor):
    """KIVI (Liu et al.): keys per channel (min/max over groups of ``group`` positions), values per
    token (groups of ``group`` channels), ``bits`` 2 or 4, the recent ``window`` in full precision."""

    name: ClassVar[str] = "kivi"
    bits: int = 2
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bits(self.name, self.bits, (2, 4))
        _check_group(self.name, self.group)

    def layouts(self) -> tuple[Layout, Layout]:
        return Layout(CHANNEL_GROUPS, self.bits, self.group), Layout(TOKEN_GROUPS, self.bits, self.group)


@dataclass
class IntQuant(QuantCompressor):
    """Per-token, per-channel-group asymmetric integer quantization (``int4``, ``int8``)."""

    name: ClassVar[str] = "int"
    bits: int = 4
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bits(self.name, self.bits, (4, 8))
        _check_group(self.name, self.group)

    def layouts(self) -> tuple[Layout, Layout]:
        return (Layout(TOKEN_GROUPS, self.bits, self.group),) * 2


@dataclass
class Int4(IntQuant):
    """INT4: per-token asymmetric 4-bit codes in channel groups of ``group``, fp16 scale and zero."""

    name: ClassVar[str] = "int4"
    bits: int = 4


@dataclass
class Int8(IntQuant):
    """INT8: per-token asymmetric 8-bit codes in channel groups of ``group``, fp16 scale and zero."""

    name: ClassVar[str] = "int8"
    bits: int = 8


@dataclass
class FP8(QuantCompressor):
    """FP8 e4m3 with one scale per KV head per batch of moved tokens (stored per token row, fp16)."""

    name: ClassVar[str] = "fp8"
    bits: ClassVar[int] = 8

    def layouts(self) -> tuple[Layout, Layout]:
        return (Layout(FP8_KIND),) * 2
