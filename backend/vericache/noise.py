"""Counter-based random numbers: a request's randomness as a function of (seed, stream, position) only.

A seeded request draws nothing from a stateful generator. Its uniform for vocabulary entry ``j`` at
sequence position ``n`` is a hash of (seed, stream, n, j), so a draft, a verification and plain full
decoding that look at the same position see the same noise, whatever order they run in, however
rounds are cut and whatever else shares the step (``sampling.choose_tokens``).

The hash is splitmix64's finalizer (Steele et al., 2014) on int64 tensors: torch's int64 arithmetic
wraps (two's complement) on every build, and ``>>`` is made logical by masking, so these are the same
bits as the unsigned reference in ``tests/test_sampling.py`` on every instruction set.
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64: splitmix64's increment
_MUL1 = -4658895280553007687            # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685            # 0x94D049BB133111EB
_U64 = (1 << 64) - 1


def _low(bits: int) -> int:
    return (1 << bits) - 1


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise on an int64 tensor (a bijection of 64-bit words)."""
    x = (x ^ ((x >> 30) & _low(34))) * _MUL1
    x = (x ^ ((x >> 27) & _low(37))) * _MUL2
    return x ^ ((x >> 31) & _low(33))


def as_int64(value: int) -> int:
    """Any integer as the signed 64-bit word with its low 64 bits (seeds may be negative or >= 2**63)."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def uniforms(seed: int, stream: int, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [T, count]: entry j of row t is a function of (seed, stream,
    positions[t], j) only. positions: int64 [T]."""
    key = mix(torch.tensor(as_int64(seed + _GOLDEN * (stream + 1)), dtype=torch.int64))
    rows = mix((key ^ positions.to(torch.int64)) + _GOLDEN)                       # [T]
    words = mix(rows[:, None] + _GOLDEN * torch.arange(1, count + 1, dtype=torch.int64))   # [T, count]
    # the top 53 bits, centred in their interval: never 0 or 1, so both logs below are finite
    return (((words >> 11) & _low(53)).double() + 0.5) * 2.0 ** -53


def gumbel(seed: int, stream: int, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), float64 [T, count], from ``uniforms``."""
    return -torch.log(-torch.log(uniforms(seed, stream, positions, count)))
