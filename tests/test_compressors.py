"""The compressor interface: spec strings, each method's storage, budgets and byte accounting."""

from __future__ import annotations

import pytest
import torch

from vericache.compress.base import Composed
from vericache.compress.registry import METHODS, describe_methods, parse_compressor
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.quantized import pack_bits, unpack_bits

EVICTION = ["streaming", "snapkv", "h2o", "kvzip"]
QUANT = ["kivi", "int4", "int8", "fp8"]


def test_registry_lists_every_method():
    assert set(METHODS) == set(EVICTION + QUANT)
    rows = {r["name"]: r for r in describe_methods()}
    assert rows["kivi"]["parameters"]["bits"] == 2 and rows["snapkv"]["parameters"]["ratio"] == 0.25


def test_spec_strings():
    c = parse_compressor("snapkv:ratio=0.125,window=16")
    assert (c.ratio, c.window) == (0.125, 16)
    comp = parse_compressor("snapkv:ratio=0.25+kivi:bits=4")
    assert isinstance(comp, Composed) and comp.quantizer.bits == 4 and comp.evictor.ratio == 0.25
    assert parse_compressor(comp.spec()).spec() == comp.spec()


@pytest.mark.parametrize("spec, needle", [
    ("zip", "unknown compressor 'zip'; available: streaming, snapkv"),
    ("snapkv:rate=0.5", "unknown parameter 'rate'; parameters: window, ratio"),
    ("snapkv:ratio=2", "ratio must be in (0, 1], got 2.0"),
    ("snapkv:ratio=abc", "ratio='abc' is not a valid float"),
    ("kivi:bits=3", "bits must be one of (2, 4), got 3"),
    ("kivi+snapkv", "eviction+quantization"),
    ("snapkv:ratio", "expected key=value"),
    ("", "non-empty"),
])
def test_bad_specs_name_what_exists(spec, needle):
    with pytest.raises(ValueError) as e:
        parse_compressor(spec)
    assert needle in str(e.value)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bit_packing_roundtrip(bits):
    codes = torch.randint(0, 2**bits, (2, 5, 64), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(packed, bits), codes)


def _filled_cache(llm, spec: str, n: int, seed: int = 0) -> CompressedKVCache:
    model = llm.loaded.model
    cache = CompressedKVCache(parse_compressor(spec), model.config, "cpu", torch.float32, capacity=2048)
    ids = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids, [0], [n], [cache])
    cache.commit(n)
    return cache


@pytest.mark.parametrize("method", EVICTION)
def test_eviction_budget_tracks_ratio_while_growing(llm, method):
    cache = _filled_cache(llm, f"{method}:ratio=0.2", 400)
    assert abs(cache.kept_tokens() - 0.2 * 400) <= 1
    model = llm.loaded.model
    with torch.no_grad():  # decode 200 more tokens, committing as lossy mode does
        for pos in range(400, 600):
            model(torch.tensor([7]), [pos], [1], [cache])
            cache.commit(pos + 1)
    # re-scored every `window` tokens: the kept set follows 20% of the grown sequence
    assert 0.2 * 600 - 1 <= cache.kept_tokens() <= 0.2 * 600 + cache.window
    assert cache.nbytes() / cache.full_nbytes() < 0.3


@pytest.mark.parametrize("spec, expected", [
    ("kivi:bits=2", (2 * 64 * 2 / 8 + 2 * 2 * 2 + 2 * 64 * 2 / 32) / (2 * 64 * 4)),  # codes + v scales + shared k scales
    ("int4", (2 * 64 * 4 / 8 + 2 * 2 * 2 * 2) / (2 * 64 * 4)),
    ("int8", (2 * 64 + 2 * 2 * 2 * 2) / (2 * 64 * 4)),
    ("fp8", (2 * 64 + 2 * 2) / (2 * 64 * 4)),
])
def test_quantized_bytes_are_measured(llm, spec, expected):
    """Per token and head, bytes held in the store match the format (fp32 model: 4-byte baseline)."""
    cache = _filled_cache(llm, spec, 1024 + 32)
    store_tokens = cache.res_start
    store_bytes = cache.nbytes() - cache.residual.nbytes()
    full_store = store_tokens * cache.residual.nbytes_per_position()
    assert store_bytes / full_store == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("method, max_rel_err", [("kivi", 0.5), ("int4", 0.2), ("int8", 0.02), ("fp8", 0.1)])
def test_quantization_error_is_small_but_nonzero(llm, method, max_rel_err):
    from vericache.kv.full import FullKVCache

    cache = _filled_cache(llm, method, 300, seed=3)
    model = llm.loaded.model
    exact = FullKVCache(model.config, "cpu", torch.float32)
    with torch.no_grad():
        model(torch.randint(0, 4000, (300,), generator=torch.Generator().manual_seed(3)), [0], [300], [exact])
    n = cache.res_start
    ref = exact.v[0, :, :n]
    rel = ((cache.dequantized(0)[1] - ref).norm() / ref.norm()).item()
    assert 0 < rel < max_rel_err  # live, and a quantizer rather than noise
    assert torch.equal(cache.residual.k[0, :, : cache.residual.length], exact.k[0, :, n:300])  # residual exact


def test_rollback_cannot_reach_compressed_positions(llm):
    cache = _filled_cache(llm, "snapkv:ratio=0.5", 300)
    with pytest.raises(ValueError, match="compressed"):
        cache.begin(10, 1)


@pytest.mark.parametrize("spec", EVICTION + QUANT)
def test_lossy_logits_differ_from_full(llm, spec):
    """Decoding one token over the compressed cache gives different logits than over the full cache."""
    from vericache.kv.full import FullKVCache

    model = llm.loaded.model
    ids = torch.randint(0, 4000, (400,), generator=torch.Generator().manual_seed(5))
    cache = _filled_cache(llm, spec, 400, seed=5)
    exact = FullKVCache(model.config, "cpu", torch.float32)
    with torch.no_grad():
        model(ids, [0], [400], [exact])
        a = model(torch.tensor([9]), [400], [1], [cache])
        b = model(torch.tensor([9]), [400], [1], [exact])
    assert (a - b).abs().max().item() > 1e-4


def _decode_lossy(llm, cache, start: int, n: int) -> None:
    """Decode n fixed tokens, committing each as lossy mode does (a full cache only stores them)."""
    model = llm.loaded.model
    with torch.no_grad():
        for pos in range(start, start + n):
            model(torch.tensor([7 + pos % 50]), [pos], [1], [cache])
            if isinstance(cache, CompressedKVCache):
                cache.commit(pos + 1)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streaming"])
def test_a_move_scores_only_entering_tokens_and_keeps_the_best(llm, method, monkeypatch):
    """Decoding moves score the entering tokens alone (H2O, which accumulates, also its kept ones);
    the store then holds exactly the budget's best candidates, each slot's K/V those of its position."""
    from vericache.kv.full import FullKVCache

    cache = _filled_cache(llm, f"{method}:ratio=0.2", 400)
    comp, seen = cache.compressor, []
    real_score = type(comp).score
    candidates = {}

    def spy(self, inp):
        out = real_score(self, inp)
        seen.append(inp.keys.shape[1])
        candidates["pos"], candidates["scores"] = inp.positions, out
        return out

    monkeypatch.setattr(type(comp), "score", spy)
    c_before, carried = cache.count, cache.kept().scores.flatten(0, 1)[:, : cache.count].clone()
    pos_before = cache.kept().pos.flatten(0, 1)[:, : cache.count].clone()
    _decode_lossy(llm, cache, 400, cache.window + 1)   # exactly one move of `window` tokens
    assert len(seen) == 1
    n = seen[0] - (c_before if comp.rescores_kept else 0)
    assert n == cache.window
    scores = candidates["scores"] if comp.rescores_kept else torch.cat([carried, candidates["scores"]], 1)
    positions = torch.cat([pos_before, candidates["pos"][:, -n:]], 1)
    best = positions.gather(1, scores.topk(cache.count, dim=1).indices).sort(dim=1).values
    assert torch.equal(cache.kept().pos.flatten(0, 1)[:, : cache.count].long().sort(dim=1).values, best)
    # every store slot holds the exact K/V of the position it names (the moves put them in the right slot)
    exact = FullKVCache(llm.loaded.model.config, "cpu", torch.float32)
    ids = torch.randint(0, 4000, (400,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        llm.loaded.model(ids, [0], [400], [exact])
    _decode_lossy(llm, exact, 400, cache.window + 1)
    k, _ = cache.dequantized(2)
    want = exact.k[2].gather(1, cache.kept().pos[2, :, : cache.count, None].long().expand(-1, -1, k.shape[2]))
    assert torch.equal(k, want)


def test_loaded_prefix_tokens_outrank_decoded_ones(llm):
    """A store filled from stored forms has no scores: its tokens are kept, entering ones compete."""
    cache = _filled_cache(llm, "snapkv:ratio=0.2", 400)
    cache.kept().scores.fill_(float("inf"))
    before = cache.kept().pos[:, :, : cache.count].flatten(0, 1).clone()
    _decode_lossy(llm, cache, 400, 3 * cache.window)
    after = cache.kept().pos[:, :, : cache.count].flatten(0, 1)
    assert cache.count > before.shape[1]
    assert all(torch.isin(b, a).all() for b, a in zip(before, after))


@pytest.mark.parametrize("s", [1, 37, 1000])
def test_observed_attention_is_the_whole_softmax_a_head_at_a_time(s):
    """SnapKV's, H2O's and KVzip's observation-window attention, computed a KV head at a time (its
    temporaries a head's, not every layer's), has the bits of the whole [H, G, W, S] form; a row is a
    probability over the S candidates times S, summed over the group's query heads."""
    import math

    from vericache.compress.base import observed_attention
    from vericache.kv.compressed import ScoreInputs

    g = torch.Generator().manual_seed(s)
    h, group, w, d = 6, 3, 8, 64
    queries, keys = torch.randn(h * group, w, d, generator=g), torch.randn(h, s, d, generator=g) * 2
    got = observed_attention(ScoreInputs(keys, torch.arange(s).expand(h, s), queries, {}, None))
    logits = torch.einsum("hgwd,hsd->hgws", queries.view(h, group, w, d), keys) / math.sqrt(d)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(got, probs.sum(dim=1) * s)
    torch.testing.assert_close(got.sum(dim=-1), torch.full((h, w), float(group * s)))
    if s > 1:   # the same probabilities summed in another order differ in bits: the check can fail
        assert not torch.equal(got, (probs[:, 2] + probs[:, 1] + probs[:, 0]) * s)
    half = keys.half()   # keys as an fp16 cache holds them: widened a head at a time, the same bits
    assert torch.equal(observed_attention(ScoreInputs(half, torch.arange(s).expand(h, s), queries, {}, None)),
                       observed_attention(ScoreInputs(half.float(), torch.arange(s).expand(h, s), queries, {}, None)))
