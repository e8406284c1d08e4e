"""KV quantization methods: each one only writes ``encode``.

Codes are bit-packed (two 4-bit or four 2-bit codes per byte) and scales are
fp16, so the bytes a cache reports are the bytes it really holds. The
dequantised K/V are computed once per batch and kept for the draft attention
(a fused GPU kernel would read the codes directly; on CPU this is the simple,
correct path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vericache.compress.base import QuantCompressor

Rows = dict[str, torch.Tensor]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] uint8 < 2**bits -> [..., D * bits / 8] uint8."""
    if bits == 8:
        return codes
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def minmax_quantize(x: torch.Tensor, dim: int | tuple[int, ...], bits: int):
    """Asymmetric uniform quantization with min/max over ``dim``.

    Returns (codes uint8 like x, scale fp16, zero fp16, dequantised x in x.dtype).
    """
    levels = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True).to(torch.float16)
    mx = x.amax(dim=dim, keepdim=True).to(torch.float16)
    scale = ((mx.float() - mn.float()).clamp_min(1e-6) / levels).to(torch.float16)
    codes = ((x.float() - mn.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    deq = (codes.float() * scale.float() + mn.float()).to(x.dtype)
    return codes, scale, mn, deq


def _check_bits(name: str, bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"{name}: bits must be one of {allowed}, got {bits!r}")


def _check_group(name: str, group: int, head_dim_hint: int = 0) -> None:
    if not isinstance(group, int) or group < 1 or group & (group - 1):
        raise ValueError(f"{name}: group must be a power of two >= 1, got {group!r}")


def _per_token_groups(x: torch.Tensor, group: int, bits: int, prefix: str) -> tuple[Rows, torch.Tensor]:
    """Per-token quantization in channel groups: x [H, n, D] -> rows, dequantised x."""
    h, n, d = x.shape
    g = min(group, d)
    xg = x.view(h, n, d // g, g)
    codes, scale, zero, deq = minmax_quantize(xg, dim=-1, bits=bits)
    rows = {f"{prefix}codes": pack_bits(codes.view(h, n, d), bits),
            f"{prefix}scale": scale.view(h, n, d // g), f"{prefix}zero": zero.view(h, n, d // g)}
    return rows, deq.view(h, n, d)


@dataclass
class KIVI(QuantCompressor):
    """KIVI (Liu et al.): keys per channel (min/max over groups of ``group`` tokens), values per
    token (groups of ``group`` channels), ``bits`` 2 or 4, the recent ``window`` in full precision."""

    name: ClassVar[str] = "kivi"
    bits: int = 2
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bits(self.name, self.bits, (2, 4))
        _check_group(self.name, self.group)

    def encode(self, k: torch.Tensor, v: torch.Tensor):
        h, n, d = k.shape
        codes, k_hat, shared_bytes = [], [], []
        for s in range(0, n, self.group):  # keys: one fp16 scale and zero per channel per token group
            c, _, _, dq = minmax_quantize(k[:, s : s + self.group], dim=1, bits=self.bits)
            t = c.shape[1]
            codes.append(c)
            k_hat.append(dq)
            # the group's scale+zero (2 x D fp16) are shared by its t tokens: each row carries 1/t
            shared_bytes.append(torch.full((h, t), 2 * d * 2 / t, device=k.device))
        vrows, v_hat = _per_token_groups(v, self.group, self.bits, "v")
        rows = {"kcodes": pack_bits(torch.cat(codes, dim=1), self.bits), **vrows,
                "kscale_bytes": torch.cat(shared_bytes, dim=1)}
        return rows, torch.cat(k_hat, dim=1), v_hat


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

    def encode(self, k: torch.Tensor, v: torch.Tensor):
        krows, k_hat = _per_token_groups(k, self.group, self.bits, "k")
        vrows, v_hat = _per_token_groups(v, self.group, self.bits, "v")
        return {**krows, **vrows}, k_hat, v_hat


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
    """FP8 e4m3 with one scale per KV head per token batch (stored per token row, fp16)."""

    name: ClassVar[str] = "fp8"
    E4M3_MAX: ClassVar[float] = 448.0
    bits: ClassVar[int] = 8

    def _one(self, x: torch.Tensor, prefix: str) -> tuple[Rows, torch.Tensor]:
        h, n, _ = x.shape
        scale = (x.abs().amax(dim=(1, 2), keepdim=True).float() / self.E4M3_MAX).clamp_min(1e-12)
        scale = scale.to(torch.float16).float()
        codes = (x.float() / scale).to(torch.float8_e4m3fn)
        deq = (codes.float() * scale).to(x.dtype)
        return {f"{prefix}codes": codes, f"{prefix}scale": scale.to(torch.float16).expand(h, n, 1).contiguous()}, deq

    def encode(self, k: torch.Tensor, v: torch.Tensor):
        krows, k_hat = self._one(k, "k")
        vrows, v_hat = self._one(v, "v")
        return {**krows, **vrows}, k_hat, v_hat
