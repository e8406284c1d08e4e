"""Coupled sampling's pieces: the counter-based noise (a function of seed, stream and position only,
the same bits on every instruction-set build), and the Gumbel-max choice as an exact sample."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

import torch

from vericache import SamplingParams
from vericache.noise import gumbel, uniforms
from vericache.sampling import choose_tokens, probs_from_logits

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix_reference(x: int) -> int:
    """splitmix64's finalizer on unsigned Python ints (the published constants)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _uniform_reference(seed: int, stream: int, position: int, j: int) -> float:
    key = _mix_reference((seed + GOLDEN * (stream + 1)) & M64)
    row = _mix_reference(((key ^ position) + GOLDEN) & M64)
    word = _mix_reference((row + GOLDEN * (j + 1)) & M64)
    return ((word >> 11) + 0.5) * 2.0 ** -53


def test_uniforms_are_the_unsigned_reference_hash():
    """int64 torch arithmetic (wrapping, logical shifts by masking) gives the unsigned hash's bits,
    for negative seeds and seeds past 2**63 too."""
    for seed in (0, 7, -3, (1 << 63) + 5, (1 << 64) - 1):
        got = uniforms(seed, 1, torch.tensor([0, 5, 123456]), 40)
        for r, pos in enumerate((0, 5, 123456)):
            for j in (0, 1, 17, 39):
                assert got[r, j].item() == _uniform_reference(seed & M64, 1, pos, j), (seed, pos, j)


def test_noise_is_a_function_of_seed_stream_and_position_only():
    rows = gumbel(11, 0, torch.tensor([3, 4, 5]), 1000)
    assert torch.equal(gumbel(11, 0, torch.tensor([4]), 1000)[0], rows[1])     # one row alone = in a batch
    assert not torch.equal(rows[0], rows[1])                                    # positions differ
    assert not torch.equal(gumbel(12, 0, torch.tensor([4]), 1000)[0], rows[1])  # seeds differ
    assert not torch.equal(gumbel(11, 1, torch.tensor([4]), 1000)[0], rows[1])  # streams differ
    g = gumbel(1, 0, torch.arange(64), 4096).flatten()                          # Gumbel(0, 1) moments
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03


def test_noise_bits_are_the_same_in_the_portable_build():
    """torch's DEFAULT (no SIMD) kernels give the same noise bits as this machine's widest build: a
    seeded text does not depend on the instruction set."""
    code = ("import torch,sys; from vericache.noise import gumbel; "
            "torch.save(gumbel(5, 0, torch.arange(100, 140), 4099), sys.argv[1])")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"noise_default_{os.getpid()}.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run([sys.executable, "-c", code, path], env=env, check=True, timeout=120)
    try:
        assert torch.equal(torch.load(path), gumbel(5, 0, torch.arange(100, 140), 4099))
    finally:
        os.unlink(path)


def test_gumbel_max_choice_is_an_exact_sample_of_the_truncated_distribution():
    """Over many positions, argmax(tempered logits + g) lands on each token as often as softmax of the
    tempered, top-k / top-p truncated logits says (Pearson chi-square at ~p = 0.001)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0]])
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=5)):
        p = probs_from_logits(logits, params)[0]
        n = 20000
        picks = choose_tokens(logits.expand(n, -1), params, seed=3, first_position=0)
        counts = Counter(picks)
        assert set(counts) <= set(torch.nonzero(p).flatten().tolist())   # nothing outside the kept set
        cells = [(counts[t], n * p[t].item()) for t in range(p.numel()) if p[t] > 0]
        chi2 = sum((o - e) ** 2 / e for o, e in cells)
        df = len(cells) - 1
        assert chi2 < df + 3.09 * math.sqrt(2 * df) + 2, (params, chi2, df)


def test_choose_tokens_is_greedy_at_temperature_zero_and_seeded_otherwise():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert choose_tokens(logits, SamplingParams(), seed=1, first_position=9) == logits.argmax(-1).tolist()
    hot = SamplingParams(temperature=1.0)
    a = choose_tokens(logits, hot, seed=1, first_position=9)
    assert a == choose_tokens(logits, hot, seed=1, first_position=9)
    assert a[2:] == choose_tokens(logits[2:], hot, seed=1, first_position=11)   # row = its position's noise
    assert any(choose_tokens(logits, hot, seed=s, first_position=9) != a for s in range(2, 6))
