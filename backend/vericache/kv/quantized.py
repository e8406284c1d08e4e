"""How quantized K/V are stored, and attention that reads them in that form.

A ``Layout`` describes one of K or V: its codes (bit-packed, low bits first) and scales. Three kinds:

- ``TOKEN_GROUPS``: per token, asymmetric min/max in groups of ``group`` channels (INT4/INT8, KIVI
  values). Per token: codes [D*bits/8] u8, scale and zero [D/group] fp16.
- ``CHANNEL_GROUPS``: per channel, min/max over groups of ``group`` consecutive positions (KIVI
  keys: key outliers live in channels). Per token: codes; per position group: scale and zero [D]
  fp16, found from the token's position (so eviction may drop tokens of a group).
- ``FP8``: e4m3 codes [D] with one fp16 scale per token row.

``encode`` and ``decode`` are the reference (torch) implementations over any leading dims. On the CPU
the packed attention op reads the codes as stored (``kernels/quant_format.h``: dequantized block by
block in L1); ``attend_quantized`` is the decode-then-attend path for other devices and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache.kernels.layouts import CHANNEL_GROUPS, FP8, TOKEN_GROUPS
from vericache.kv.attention import Part, attend_all

E4M3_MAX = 448.0


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] uint8 < 2**bits -> [..., D * bits / 8] uint8, planar: byte i holds channels
    i, i + D/per, i + 2D/per, ... (first in the low bits), so a kernel unpacks contiguous channel runs."""
    if bits == 8:
        return codes
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], per, codes.shape[-1] // per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device)[:, None] * bits
    return (c << shifts).sum(-2).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device)[:, None] * bits
    c = (packed.to(torch.int32)[..., None, :] >> shifts) & ((1 << bits) - 1)             # [..., per, D/per]
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def minmax_quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with min/max over ``dim``: (codes uint8, scale fp16, zero fp16)."""
    levels = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True).to(torch.float16)
    mx = x.amax(dim=dim, keepdim=True).to(torch.float16)
    scale = ((mx.float() - mn.float()).clamp_min(1e-6) / levels).to(torch.float16)
    codes = ((x.float() - mn.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return codes, scale, mn


# a quantized part's K or V as stored: {"tok": {field: [Hkv, C, w]}, "grp": {field: [Hkv, NG, w]}}
StoredFields = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    kind: int
    bits: int = 8
    group: int = 32

    def group_size(self, d: int) -> int:
        """Channels per scale group for head dimension ``d``."""
        return min(self.group, d)

    def token_fields(self, d: int) -> dict[str, tuple[int, torch.dtype]]:
        """Per stored token and head: field -> (width, dtype)."""
        if self.kind == FP8:
            return {"codes": (d, torch.uint8), "scale": (1, torch.float16)}
        fields = {"codes": (d * self.bits // 8, torch.uint8)}
        if self.kind == TOKEN_GROUPS:
            fields |= {"scale": (d // self.group_size(d), torch.float16), "zero": (d // self.group_size(d), torch.float16)}
        return fields

    def group_fields(self, d: int) -> dict[str, tuple[int, torch.dtype]]:
        """Per group of ``group`` positions and head (CHANNEL_GROUPS only)."""
        return {"scale": (d, torch.float16), "zero": (d, torch.float16)} if self.kind == CHANNEL_GROUPS else {}

    def bytes_per_token(self, d: int) -> float:
        """Stored bytes per token and head (group fields shared by ``group`` positions)."""
        def size(fields: dict[str, tuple[int, torch.dtype]]) -> int:
            return sum(w * dt.itemsize for w, dt in fields.values())

        return size(self.token_fields(d)) + size(self.group_fields(d)) / self.group

    @property
    def align(self) -> int:
        """Positions move into the store in multiples of this (whole position groups)."""
        return self.group if self.kind == CHANNEL_GROUPS else 1

    def encode(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """x: [..., n, D] -> (token fields {name: [..., n, w]}, group fields {name: [..., n/group, D]})."""
        *lead, n, d = x.shape
        if self.kind == FP8:
            scale = (x.abs().amax(dim=(-2, -1), keepdim=True).float() / E4M3_MAX).clamp_min(1e-12).to(torch.float16)
            codes = (x.float() / scale.float()).to(torch.float8_e4m3fn).view(torch.uint8)
            return {"codes": codes, "scale": scale.expand(*lead, n, 1).contiguous()}, {}
        if self.kind == TOKEN_GROUPS:
            g = self.group_size(d)
            codes, scale, zero = minmax_quantize(x.reshape(*lead, n, d // g, g), -1, self.bits)
            return {"codes": pack_bits(codes.reshape(*lead, n, d), self.bits),
                    "scale": scale.reshape(*lead, n, d // g), "zero": zero.reshape(*lead, n, d // g)}, {}
        if n % self.group:
            raise ValueError(f"channel-group encoding needs a multiple of {self.group} positions, got {n}")
        codes, scale, zero = minmax_quantize(x.reshape(*lead, n // self.group, self.group, d), -2, self.bits)
        return ({"codes": pack_bits(codes.reshape(*lead, n, d), self.bits)},
                {"scale": scale.squeeze(-2), "zero": zero.squeeze(-2)})

    def encode_tokens(self, x: torch.Tensor, grp: dict[str, torch.Tensor] | None = None,
                      pos: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Single tokens x [n, D] -> token fields {name: [n, w]}, as a store holds them. Channel groups
        (KIVI keys) take the existing tables ``grp`` {name: [n, D]} of each token's position group
        (``pos`` [n]; the token was part of its group when the tables were made)."""
        if self.kind != CHANNEL_GROUPS:   # per-token fields: each token encoded alone
            tok, _ = self.encode(x[:, None])
            return {f: y[:, 0] for f, y in tok.items()}
        if grp is None:
            raise ValueError("channel-group encoding of single tokens needs their groups' tables (grp)")
        levels = (1 << self.bits) - 1
        codes = ((x.float() - grp["zero"].float()) / grp["scale"].float()).round().clamp(0, levels)
        return {"codes": pack_bits(codes.to(torch.uint8), self.bits)}

    def decode(self, tok: dict[str, torch.Tensor], grp: dict[str, torch.Tensor], d: int,
               pos: torch.Tensor | None = None) -> torch.Tensor:
        """The reference dequantization: token fields [..., n, w] (and group tables [..., NG, D]
        with positions [..., n], default 0..n-1) -> fp32 [..., n, D]."""
        if self.kind == FP8:
            return tok["codes"].view(torch.float8_e4m3fn).float() * tok["scale"].float()
        codes = unpack_bits(tok["codes"], self.bits).float()
        if self.kind == TOKEN_GROUPS:
            g = self.group_size(d)
            c = codes.view(*codes.shape[:-1], d // g, g)
            return (c * tok["scale"].float()[..., None] + tok["zero"].float()[..., None]).flatten(-2)
        n = codes.shape[-2]
        if pos is None:
            pos = torch.arange(n, device=codes.device).expand(codes.shape[:-1])
        idx = (pos.long() // self.group)[..., None].expand(*pos.shape, d)          # [..., n, D]
        return codes * grp["scale"].float().gather(-2, idx) + grp["zero"].float().gather(-2, idx)


def attend_quantized(q: torch.Tensor, layouts: tuple[Layout, Layout], k: StoredFields, v: StoredFields, n: int,
                     pos: torch.Tensor | None = None) -> Part:
    """Every query over the first ``n`` stored tokens of one layer, dequantized then attended (CUDA;
    the CPU's packed op reads the codes in place and is tested against this).

    q: [Hq, T, D]; k, v: {"tok": {field: [Hkv, C, w]}, "grp": {field: [Hkv, NG, D]}} for K and V;
    pos: [Hkv, C] int32 positions (needed by CHANNEL_GROUPS under eviction) -> (out [Hq, T, D], lse [Hq, T]).
    """
    d = q.shape[2]
    sub_pos = None if pos is None else pos[:, :n]
    kd, vd = (layout.decode({f: x[:, :n] for f, x in part["tok"].items()}, part["grp"], d, sub_pos)
              for layout, part in zip(layouts, (k, v)))
    return attend_all(q, kd.to(q.dtype), vd.to(q.dtype))
