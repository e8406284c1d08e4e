"""Quantized KV read as stored: the packed op's quantized parts against dequantize-then-attend (fp32,
1e-5), and caches whose resident bytes are what admission and accounting charge."""

from __future__ import annotations

import pytest
import torch

from conftest import bare_loop
from vericache import SamplingParams
from vericache.compress.base import EvictionCompressor
from vericache.compress.registry import METHODS, parse_compressor
from vericache.engine.options import RequestOptions
from vericache.engine.requests import State
from vericache.kv.attention import attend_all
from vericache.kv.full import storage_bytes
from vericache.kv.packed import KeyPart, attend_packed, key_codes_bytes, new_key_codes
from vericache.kv.quantized import CHANNEL_GROUPS, FP8, TOKEN_GROUPS, Layout, attend_quantized

LAYOUTS = {
    "kivi2": (Layout(CHANNEL_GROUPS, 2, 32), Layout(TOKEN_GROUPS, 2, 32)),
    "kivi4": (Layout(CHANNEL_GROUPS, 4, 32), Layout(TOKEN_GROUPS, 4, 32)),
    "int4": (Layout(TOKEN_GROUPS, 4, 32),) * 2,
    "int8-g16": (Layout(TOKEN_GROUPS, 8, 16),) * 2,
    "fp8": (Layout(FP8),) * 2,
}


def _encoded(layouts, k, v):
    (kt, kg), (vt, vg) = layouts[0].encode(k), layouts[1].encode(v)
    return {"tok": kt, "grp": kg}, {"tok": vt, "grp": vg}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("n, t", [(1, 1), (31, 1), (32, 3), (33, 1), (65, 2), (200, 1), (1031, 4)])
def test_packed_op_matches_dequantize_then_attend(name, n, t):
    layouts = LAYOUTS[name]
    g = torch.Generator().manual_seed(n * 7 + t)
    hkv, groups, d, stored = 3, 3, 64, -(-n // 32) * 32 + 32   # capacity past n: the kernel reads only n
    k, v = torch.randn(hkv, stored, d, generator=g) * 2, torch.randn(hkv, stored, d, generator=g)
    k[:, :, 5] += 8.0                                                 # an outlier channel, as real keys have
    q = torch.randn(hkv * groups, t, d, generator=g)
    kp, vp = _encoded(layouts, k, v)
    out = attend_packed(q, [t], [[KeyPart(kp, vp, n=n, layouts=layouts)]], hkv).transpose(0, 1)
    kd = layouts[0].decode({f: x[:, :n] for f, x in kp["tok"].items()}, kp["grp"], d)
    vd = layouts[1].decode({f: x[:, :n] for f, x in vp["tok"].items()}, vp["grp"], d)
    ref_out, _ = attend_all(q, kd, vd)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (attend_quantized(q, layouts, kp, vp, n)[0] - ref_out).abs().max().item() < 1e-5   # the torch path
    assert (kd - k[:, :n]).abs().max() > 0                            # really quantized


@pytest.mark.parametrize("name", ["kivi2", "int4", "fp8"])
def test_packed_op_reads_evicted_token_sets(name):
    """Under eviction each head keeps its own positions; KIVI keys find their group by position."""
    layouts = LAYOUTS[name]
    g = torch.Generator().manual_seed(3)
    hkv, d, seen, kept = 3, 64, 320, 77
    k, v = torch.randn(hkv, seen, d, generator=g), torch.randn(hkv, seen, d, generator=g)
    kp, vp = _encoded(layouts, k, v)
    pos = torch.stack([torch.randperm(seen, generator=g)[:kept].sort().values for _ in range(hkv)]).int()
    idx = pos.long()[..., None]
    sub = lambda part: {"tok": {f: x.gather(1, idx.expand(-1, -1, x.shape[2])) for f, x in part["tok"].items()},  # noqa: E731
                        "grp": part["grp"]}
    kp_kept, vp_kept = sub(kp), sub(vp)
    q = torch.randn(hkv * 3, 1, d, generator=g)
    out = attend_packed(q, [1], [[KeyPart(kp_kept, vp_kept, n=kept, layouts=layouts, pos=pos)]], hkv).transpose(0, 1)
    ref, _ = attend_quantized(q, layouts, kp_kept, vp_kept, kept, pos)
    assert (out - ref).abs().max().item() < 1e-5


# every registered method (evictions keeping 20%, quantizers at their defaults: KIVI 2-bit), KIVI
# 4-bit and a composition
SPECS = [f"{name}:ratio=0.2" if issubclass(cls, EvictionCompressor) else name for name, cls in METHODS.items()] + [
    "kivi:bits=4", "snapkv:ratio=0.125+kivi:bits=2"]


@pytest.fixture(scope="module")
def prompt_4k():
    return torch.randint(1, 4000, (4096,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("mode", ["lossy", "vericache"])
@pytest.mark.parametrize("spec", SPECS)
def test_resident_bytes_are_what_is_charged(llm, prompt_4k, spec, mode):
    """After a 4K prefill, the bytes of every storage a request's caches hold (each counted once)
    equal what admission planned and what the device pool is charged, within 5%."""
    loop = bare_loop(llm.loaded, mode=mode, compressor=spec, tiered=False, prefill_chunk=4096)
    rid = loop.add_request(prompt_4k, SamplingParams(max_tokens=8, ignore_eos=True), RequestOptions(mode=mode))
    req = loop.requests[rid]
    while req.state in (State.WAITING, State.PREFILL):
        loop.step()
    resident = req.kv.resident_bytes()
    assert resident == pytest.approx(loop.memory.device_bytes(req), rel=0.05)
    assert resident == pytest.approx(loop.memory.needed(req), rel=0.05)
    full = len(prompt_4k) * loop.memory.per_pos
    draft = req.kv.draft.resident_bytes()
    nominal = parse_compressor(spec).nominal_ratio(llm.loaded.kv_dtype.itemsize)
    assert draft < (nominal + 0.15) * full   # really compressed (stored over full bytes, in the KV's dtype)
    while loop.has_unfinished():
        loop.step()
    assert loop.device.used_blocks == 0


def test_key_codes_bytes_are_what_new_key_codes_allocates():
    for layers, heads, capacity, dim in ((2, 2, 1, 64), (30, 3, 4100, 64), (24, 2, 128, 128)):
        codes = new_key_codes(layers, heads, capacity, dim, torch.device("cpu"))
        assert storage_bytes([*codes.arrays(), codes.coded]) == key_codes_bytes(layers, heads, capacity, dim)


@pytest.fixture(scope="module")
def q8qk_tiny():
    from vericache.model.loader import load_model

    return load_model("tiny", device="cpu", dtype="float32", numerics="q8qk")


@pytest.mark.parametrize("mode,spec", [("full", "snapkv:ratio=0.2"), ("vericache", "snapkv:ratio=0.2"),
                                       ("vericache", "kivi:bits=2"), ("lossy", "h2o:ratio=0.2")])
def test_q8qk_key_codes_are_planned_and_charged(q8qk_tiny, prompt_4k, mode, spec):
    """Under q8qk the caches keep their keys' codes (55% over fp16 K and V at D = 64): admission plans
    them and the device pool is charged for them, so both match the storage the caches hold (within 5%;
    without the codes a full cache's plan falls short by their share, which this would catch)."""
    loop = bare_loop(q8qk_tiny, mode=mode, compressor=spec, tiered=False, prefill_chunk=4096)
    rid = loop.add_request(prompt_4k, SamplingParams(max_tokens=8, ignore_eos=True), RequestOptions(mode=mode))
    req = loop.requests[rid]
    while req.state in (State.WAITING, State.PREFILL):
        loop.step()
    resident = req.kv.resident_bytes()
    codes = sum(storage_bytes(list(c.codes.arrays())) for c in (req.kv.full, req.kv.draft) if c is not None
                and c.codes is not None)
    codes += req.kv.draft.residual.held_bytes() - req.kv.draft.residual.nbytes() if req.kv.draft else 0
    assert codes > 0.2 * resident   # the codes are a real share of what is held ...
    assert resident == pytest.approx(loop.memory.device_bytes(req), rel=0.05)   # ... and charged
    assert resident == pytest.approx(loop.memory.needed(req), rel=0.05)         # ... and planned
    while loop.has_unfinished():
        loop.step()
    assert loop.device.used_blocks == 0
