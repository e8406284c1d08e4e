"""Losslessness: VeriCache output == full-KV output, token for token, for every compressor.

The matrix: every method (and a composition) x batch {1, 4 of mixed lengths} x draft length {1, 8, 32,
auto} x the full KV in fp16 (the CPU's default) or fp32 (identity is to full decoding with the same KV
dtype), over prompts that include >= 1K-token code contexts and a retrieval task, weights fp32 (see
docs/DESIGN.md for the bf16 near-tie caveat). It runs as an all-pairs design (``all_pairs``): every
(method, draft length) once, the batch and KV dtype chosen so that every pair of values of any two axes
occurs; 36 cases where the product is 144 (a test checks the covering).
"""

from __future__ import annotations

import json
import pickle
import random

import pytest
import torch

from vericache import SamplingParams
from vericache.compress.base import EvictionCompressor
from vericache.compress.eviction import KVzip
from vericache.compress.registry import METHODS, parse_compressor
from vericache.engine.engine import Engine


def registered(settings: dict[str, str], skip: frozenset = frozenset()) -> list[str]:
    """Every registered method (a new one joins by being registered): evictions keep 10% of the
    tokens, quantizers run with ``settings``' parameters or their defaults; plus one composition."""
    specs = []
    for name, cls in METHODS.items():
        if name in skip:
            continue
        params = settings.get(name, "ratio=0.1" if issubclass(cls, EvictionCompressor) else "")
        specs.append(f"{name}:{params}" if params else name)
    return specs + ["snapkv:ratio=0.1+kivi:bits=2"]


# aggressive settings, so that the drafter really is lossy
COMPRESSORS = registered({"kivi": "bits=2", "int8": "window=8", "fp8": "window=8"})
DRAFT_LENS = [1, 8, 32, "auto"]
BATCHES = [1, 4]
DRAFT_WEIGHTS = ["q8", "int8", "int4", "auto"]
MAX_TOKENS = 24
KV_DTYPES = ["float16", "float32"]


def all_pairs(first: list, second: list, *binary: list) -> list[tuple]:
    """Every (first, second) value pair once, with up to two more axes of two values each chosen so that
    each pair of values of any two axes occurs in some case (with two more, ``second`` needs >= 3 values)."""
    picks = ((lambda i, j: (i + j) % 2), (lambda i, j: (i + j // 2) % 2))
    return [(a, b, *(axis[pick(i, j)] for axis, pick in zip(binary, picks))) for i, a in enumerate(first)
            for j, b in enumerate(second)]


@pytest.fixture(scope="session")
def loaded_kv(llm):
    """kv dtype -> the test model with its full KV in it (the session's ``llm`` holds the default, fp16)."""
    from vericache.model.loader import load_model

    models = {str(llm.loaded.kv_dtype).removeprefix("torch."): llm.loaded}

    def get(kv_dtype: str):
        if kv_dtype not in models:
            models[kv_dtype] = load_model("tiny", device="cpu", dtype="float32", kv_dtype=kv_dtype)
        return models[kv_dtype]
    return get


@pytest.fixture(scope="session", params=KV_DTYPES)
def kv_loaded(request, loaded_kv):
    """The test model with its full KV in each dtype, for the tests run in both."""
    return loaded_kv(request.param)


@pytest.fixture(scope="session")
def identity_prompts(llm, code_prompts) -> list[list[int]]:
    from vericache_lab.data.tasks import retrieval_task
    from vericache_lab.eval.model_quality import build_prompt

    tok = llm.tokenizer
    rng = random.Random(11)
    filler = tok.encode(code_prompts["long"])
    task = retrieval_task(rng, 40, heldout=True)
    retrieval, _ = build_prompt(tok, task, filler, 1024, rng)
    return [tok.encode(code_prompts["long"]), retrieval, tok.encode(code_prompts["short"]),
            tok.encode(code_prompts["medium"])]


@pytest.fixture(scope="session")
def references(loaded_kv, identity_prompts):
    """kv dtype -> full decoding's tokens for each identity prompt, alone, with the full KV in it."""
    done: dict[str, list[list[int]]] = {}

    def get(kv_dtype: str) -> list[list[int]]:
        if kv_dtype not in done:
            runner, params = Engine(loaded_kv(kv_dtype), mode="full"), SamplingParams(max_tokens=MAX_TOKENS)
            done[kv_dtype] = [runner.generate([runner.new_sequence(i, p, params)], "full")[0].token_ids
                              for i, p in enumerate(identity_prompts)]
        return done[kv_dtype]
    return get


def test_the_identity_matrix_covers_every_pair_of_values():
    """The all-pairs design leaves no pair of two axes' values untried (and is smaller than the product)."""
    from itertools import combinations, product

    for axes in ([COMPRESSORS, DRAFT_LENS, BATCHES, KV_DTYPES], [COMPRESSORS, DRAFT_WEIGHTS, KV_DTYPES]):
        cases = all_pairs(*axes)
        for x, y in combinations(range(len(axes)), 2):
            assert {(c[x], c[y]) for c in cases} == set(product(axes[x], axes[y])), (x, y)
        assert len(cases) == len(axes[0]) * len(axes[1]) < len(list(product(*axes)))
    cases = all_pairs(COMPRESSORS, DRAFT_LENS, BATCHES, KV_DTYPES)
    broken = [(a, b, BATCHES[0], d) for a, b, _, d in cases]   # the batch never varied
    assert {(c[1], c[2]) for c in broken} != set(product(DRAFT_LENS, BATCHES))


def _run(loaded, spec, draft_len, prompts, mode="vericache"):
    runner = Engine(loaded, mode=mode, compressor=spec, draft_len=draft_len)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("spec,draft_len,batch,kv_dtype", all_pairs(COMPRESSORS, DRAFT_LENS, BATCHES, KV_DTYPES))
def test_vericache_equals_full(loaded_kv, identity_prompts, references, spec, draft_len, batch, kv_dtype):
    outs = _run(loaded_kv(kv_dtype), spec, draft_len, identity_prompts[:batch])
    for out, ref in zip(outs, references(kv_dtype)):
        assert out.token_ids == ref
        st = out.stats
        assert st["mode"] == "vericache" and st["compressor"] == parse_compressor(spec).spec()
        assert st["accepted_tokens"] <= st["drafted_tokens"]
        if draft_len != "auto":
            assert st["drafted_tokens"] <= st["rounds"] * draft_len


@pytest.mark.parametrize("spec,weights,kv_dtype", all_pairs(COMPRESSORS, DRAFT_WEIGHTS, KV_DTYPES))
def test_vericache_with_quantized_draft_weights_equals_full(loaded_kv, identity_prompts, references, spec, weights,
                                                            kv_dtype):
    """Drafts on int8 or int4 weights (and compressed KV), verification on the exact ones: still the full
    output (every method x every weights form, each KV dtype with both)."""
    # a fixed length, so drafts run on those weights whatever the cost model would find paying here
    runner = Engine(loaded_kv(kv_dtype), mode="vericache", compressor=spec, draft_len=4, draft_weights=weights)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outs = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(identity_prompts)])
    assert [o.token_ids for o in outs] == references(kv_dtype)
    assert all(o.stats["drafted_tokens"] > 0 for o in outs)


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_vericache_with_a_draft_vocabulary_equals_full(loaded_kv, identity_prompts, references, spec):
    """Drafts over the first 256 of the test model's 4,096 tokens (and their prompts' rare ones),
    verification over all: still the full output for every method, batched, with the vocabulary live
    (draft rows took it) and over a third of full decoding's tokens past its first 256."""
    loaded = loaded_kv("float16")
    runner = Engine(loaded, mode="vericache", compressor=spec, draft_len=4, draft_vocab=256)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outs = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(identity_prompts)])
    assert [o.token_ids for o in outs] == references("float16")
    assert sum(s.vocab_rows for s in runner.instruments.steps) > 0
    assert sum(t >= 256 for ref in references("float16") for t in ref) > len(references("float16")) * MAX_TOKENS / 3


def test_a_draft_vocabulary_proposes_the_prompts_rare_tokens(loaded_kv, identity_prompts, references, monkeypatch):
    """Without its prompt's tokens past the vocabulary a draft cannot propose them, and the code model's
    outputs copy such tokens: the same text, fewer drafts accepted (the extra tokens are live). An engine
    sharing the model with another engine's vocabulary (built after it: the model holds the other's when
    its prompts end) takes its own."""
    from vericache.engine.requests import Drafting

    def accepted(other: bool = False) -> int:
        runner = Engine(loaded_kv("float16"), mode="vericache", compressor="snapkv:ratio=0.1", draft_len=4,
                        draft_vocab=256, lookup=False)
        if other:
            Engine(loaded_kv("float16"), mode="vericache", draft_vocab=0)
        params = SamplingParams(max_tokens=MAX_TOKENS)
        outs = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(identity_prompts)])
        assert [o.token_ids for o in outs] == references("float16")
        return sum(o.stats["accepted_tokens"] for o in outs)

    with_extra = accepted()
    assert accepted(other=True) == with_extra
    monkeypatch.setattr(Drafting, "take_rare_tokens", lambda self, ids, n: None)
    assert accepted() < with_extra


@pytest.fixture(scope="session")
def lossy_prompts(llm) -> list[list[int]]:
    from vericache_lab.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 4800)
    return [ids[i * 1200 : (i + 1) * 1200] for i in range(4)]


# int8 is excluded: on these prompts its error never flips a greedy token (its logits do
# differ: tests/test_compressors.py::test_lossy_logits_differ_from_full checks that).
LOSSY_SPECS = registered({"kivi": "bits=2", "int4": "group=64,window=4", "fp8": "window=1"}, skip=frozenset({"int8"}))


@pytest.fixture(scope="module")
def q8_loaded():
    """The test model in the q8 numerics (its float linears read as Q8_0 blocks times int8 activations)."""
    from vericache.model.loader import load_model

    return load_model("tiny", device="cpu", dtype="float32", numerics="q8")


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_vericache_equals_full_in_the_q8_numerics(q8_loaded, identity_prompts, spec):
    """Full decoding, verification and drafts share the q8 numerics: VeriCache equals full decoding in
    them too, batched (mixed lengths) at a fixed and an adaptive draft length."""
    full = _run(q8_loaded, spec, 8, identity_prompts, mode="full")
    assert [o.token_ids for o in _run(q8_loaded, spec, 8, identity_prompts)] == [o.token_ids for o in full]
    assert [o.token_ids for o in _run(q8_loaded, spec, "auto", identity_prompts[:2])] == \
        [o.token_ids for o in full[:2]]


@pytest.mark.parametrize("spec", LOSSY_SPECS)
def test_lossy_mode_is_really_lossy(llm, lossy_prompts, spec):
    """Proof the compressor is live: decoding from the compressed KV alone drifts from full."""
    runner = Engine(llm.loaded, mode="lossy", compressor=spec)
    params = SamplingParams(max_tokens=64)
    full = Engine(llm.loaded, mode="full").generate([runner.new_sequence(i, p, params) for i, p in enumerate(lossy_prompts)])
    lossy = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(lossy_prompts)])
    assert any(o.token_ids != ref.token_ids for o, ref in zip(lossy, full))
    nominal = parse_compressor(spec).nominal_ratio(llm.loaded.kv_dtype.itemsize)   # stored / full bytes
    assert all(o.stats["compression_ratio"] < min(nominal + 0.1, 0.7) for o in lossy)


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.1", "h2o:ratio=0.1", "streaming:ratio=0.1", "kivi:bits=2",
                                  "snapkv:ratio=0.1+kivi:bits=2"])
def test_shared_prefill_equals_own_prefill_in_every_mode(kv_loaded, identity_prompts, spec):
    """One exact prefill reused by full, lossy and vericache gives what each mode's own prefill gives."""
    runner = Engine(kv_loaded, compressor=spec, mode="full")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompts = identity_prompts[:2]
    shared = [runner.shared_prefill(runner.new_sequence(i, p, params)) for i, p in enumerate(prompts)]
    for mode in ("full", "lossy", "vericache"):
        own = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(prompts)], mode)
        reused = runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(prompts)], mode, prefills=shared)
        assert [o.token_ids for o in reused] == [o.token_ids for o in own], mode
    with pytest.raises(ValueError, match="2 prefills for 1 requests"):
        runner.generate([runner.new_sequence(0, prompts[0], params)], "full", prefills=shared)
    with pytest.raises(ValueError, match="this prefill is of"):  # a prefill of another prompt
        runner.generate([runner.new_sequence(0, prompts[0] + [1], params)], "lossy", prefills=shared[:1])


def test_kvzip_scores_a_shared_prefill_once(kv_loaded, identity_prompts, monkeypatch):
    """KVzip's reconstruction pass (a second forward over the prompt) runs once per shared prefill: the
    lossy and VeriCache requests after the first take its scores, and decode as with their own; a prefill
    pickled before scores were kept loads with none."""
    calls = []
    real = KVzip.scoring_cache   # called once as each pass starts
    monkeypatch.setattr(KVzip, "scoring_cache", lambda self, *a: calls.append(1) or real(self, *a))
    runner = Engine(kv_loaded, compressor="kvzip:ratio=0.1", mode="full")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompt = identity_prompts[0]
    shared = runner.shared_prefill(runner.new_sequence(0, prompt, params))
    own = {mode: runner.generate([runner.new_sequence(0, prompt, params)], mode)[0] for mode in ("lossy", "vericache")}
    assert len(calls) == 2   # each request's own prefill scores its prompt
    for mode in ("lossy", "vericache", "lossy"):
        assert runner.generate([runner.new_sequence(0, prompt, params)], mode, prefills=[shared])[0].token_ids \
            == own[mode].token_ids, mode
    assert len(calls) == 3 and list(shared.scores) == [parse_compressor("kvzip:ratio=0.1").spec()]
    del shared.__dict__["scores"]   # as a prefill pickled before scores were kept
    old = pickle.loads(pickle.dumps(shared))
    assert old.scores == {} and old.prompt_len == shared.prompt_len


def test_one_shared_prefill_for_requests_that_run_together(kv_loaded, identity_prompts):
    """A request decodes in its shared prefill's cache, so one prefill given for several requests of one
    ``generate`` is copied for all but the first: each decodes as with its own prefill (before the copy
    they all wrote into one cache: verifications failed past its capacity). Adding a request over a
    prefill another unfinished request holds is a ValueError naming the holder, and changes nothing."""
    runner = Engine(kv_loaded, compressor="snapkv:ratio=0.1", mode="vericache")
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s) for s in (1, 2, 3)]
    prompt = identity_prompts[0]
    own = runner.generate([runner.new_sequence(i, prompt, p) for i, p in enumerate(params)])
    shared = runner.shared_prefill(runner.new_sequence(0, prompt, params[0]))
    prefills = [shared] * 3
    reused = runner.generate([runner.new_sequence(i, prompt, p) for i, p in enumerate(params)], prefills=prefills)
    assert [o.token_ids for o in reused] == [o.token_ids for o in own]
    assert len({tuple(o.token_ids) for o in own}) > 1 and prefills == [shared] * 3   # three seeds, three texts
    holder = runner.add_sequence(runner.new_sequence(7, prompt, params[0]), prefill=shared)
    with pytest.raises(ValueError, match=f"held by request {holder} until it finishes; give request 8 prefill.copy"):
        runner.add_sequence(runner.new_sequence(8, prompt, params[1]), prefill=shared)
    assert runner.counts() == (0, 1)
    while runner.has_unfinished():
        runner.step()
    runner.add_sequence(runner.new_sequence(9, prompt, params[1]), prefill=shared)   # free again once it is done
    while runner.has_unfinished():
        runner.step()


def test_a_prefill_extending_a_shared_prefix_is_the_whole_prompts_bits(kv_loaded, identity_prompts):
    """``shared_prefill(prefix=)`` (an evaluation grid's long context prefilled once, each problem's
    prompt after it): the same K/V, logits and query window bit for bit as prefilling the whole prompt;
    a prefix that is not one is refused. Shown once that the check sees a difference: the prefix's
    cache altered, the extension's bits differ."""
    runner = Engine(kv_loaded, mode="full").runner
    params = SamplingParams(max_tokens=8)
    prompt = identity_prompts[0]
    cut = len(prompt) // 2 + 3   # not on a prefill-chunk boundary
    whole = runner.shared_prefill(runner.new_sequence(0, prompt, params))
    prefix = runner.shared_prefill(runner.new_sequence(0, prompt[:cut], SamplingParams(max_tokens=1)))
    extended = runner.shared_prefill(runner.new_sequence(0, prompt, params), prefix=prefix)
    n = len(prompt)
    assert extended.prompt_len == n and extended.prompt_ids == tuple(prompt)
    assert torch.equal(extended.full.k[:, :, :n], whole.full.k[:, :, :n]) and torch.equal(extended.full.v[:, :, :n], whole.full.v[:, :, :n])
    assert torch.equal(extended.logits, whole.logits)
    assert all(torch.equal(a, b) for a, b in zip(extended.queries, whole.queries))
    for bad in (prompt[:cut], [prompt[0] + 1] + prompt[1:]):   # the prefix itself; another prompt
        with pytest.raises(ValueError, match="not a proper prefix"):
            runner.shared_prefill(runner.new_sequence(0, bad, params), prefix=prefix)
    with torch.inference_mode():
        prefix.full.k[:, :, cut - 1] += 1.0      # a broken copy of the prefix
    broken = runner.shared_prefill(runner.new_sequence(0, prompt, params), prefix=prefix)
    assert not torch.equal(broken.logits, whole.logits)


# ---------------------------------------------------------------- near ties: identical by construction
def near_tie_checkpoint(tmp_path_factory):
    """The bundled model with an untied output head whose rows come in near-duplicate pairs (row 2j+1 =
    row 2j times 1 + 1e-6 noise per element): every greedy choice inside a pair is decided by the
    logits' last bits, so any op whose bits depend on the batch changes the output (MKL's F.linear,
    whose bits change with the rows in a call, decodes these prompts differently alone and batched)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vericache.model.registry import resolve_model

    src, out = resolve_model("tiny"), tmp_path_factory.mktemp("near_tie")
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    head = state["model.embed_tokens.weight"].float()   # fp32: bf16 would round the twins back together
    noise = 1 + 1e-6 * torch.randn(head[1::2].shape, generator=torch.Generator().manual_seed(0))
    head[1::2] = head[0::2] * noise
    state["lm_head.weight"] = head
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def near_tie_dir(tmp_path_factory):
    return near_tie_checkpoint(tmp_path_factory)


# (kv dtype, numerics): fp32 numerics with both KV dtypes, the q8 numerics (its linears, the head
# included, as Q8_0 blocks times int8 activations) with the CPU's default fp16 KV, and q8qk (q8 with
# attention in integer dots: ``kernels/int_scores.h``)
NEAR_TIE_VARIANTS = [(kv, "fp32") for kv in KV_DTYPES] + [("float16", "q8"), ("float16", "q8qk")]


@pytest.fixture(scope="module", params=NEAR_TIE_VARIANTS, ids=[f"{kv}-{n}" for kv, n in NEAR_TIE_VARIANTS])
def near_tie_model(request, near_tie_dir):
    from vericache.model.loader import load_model

    kv_dtype, numerics = request.param
    return load_model(near_tie_dir, device="cpu", dtype="float32", kv_dtype=kv_dtype, numerics=numerics)


def _generate(runner, prompts, max_tokens=MAX_TOKENS, mode=None):
    params = SamplingParams(max_tokens=max_tokens)
    return [o.token_ids for o in runner.generate([runner.new_sequence(i, p, params) for i, p in enumerate(prompts)], mode)]


@pytest.fixture(scope="module")
def near_tie_reference(near_tie_model, identity_prompts):
    """Full-KV decoding of each prompt alone, and the same prompts batched (mixed lengths)."""
    runner = Engine(near_tie_model, mode="full")
    prompts = [p[-300:] for p in identity_prompts]
    alone = [_generate(runner, [p])[0] for p in prompts]
    return prompts, alone


def test_near_tie_weights_decode_the_same_alone_and_batched(near_tie_model, near_tie_reference):
    prompts, alone = near_tie_reference
    head = near_tie_model.model.head_exact.weight
    want = "F32" if near_tie_model.numerics == "fp32" else "Q8_0"
    assert head.fmt == want and head.n == near_tie_model.config.vocab_size
    assert _generate(Engine(near_tie_model, mode="full"), prompts) == alone


def test_near_tie_weights_catch_a_batch_dependent_matmul(near_tie_dir, identity_prompts):
    """The negative control: the same checkpoint on PyTorch's kernels (MKL's ``F.linear``, whose bits
    change with the rows in a call) decodes the prompts differently alone and batched, so the test
    above would catch a linear op that is not batch-invariant."""
    from vericache.model.loader import load_model

    loaded = load_model(near_tie_dir, device="cpu", dtype="float32", kernels="torch")
    prompts = [p[-300:] for p in identity_prompts]
    runner = Engine(loaded, mode="full")
    alone = [_generate(runner, [p])[0] for p in prompts]
    assert _generate(runner, prompts) != alone


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_near_tie_weights_vericache_equals_full(near_tie_model, near_tie_reference, spec):
    prompts, alone = near_tie_reference
    runner = Engine(near_tie_model, mode="vericache", compressor=spec, draft_len=8)
    assert _generate(runner, prompts) == alone


# ---------------------------------------------------------------- seeded sampling: the same bits
# (temperature, top-p, top-k): tempered with nucleus truncation, and hotter with a top-k cut
SAMPLED = [(0.7, 0.9, 0), (1.0, 1.0, 20)]


def _seeded(loaded, prompts, mode, temperature, top_p, top_k, **settings) -> list:
    runner = Engine(loaded, mode=mode, **settings)
    seqs = [runner.new_sequence(i, p, SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p,
                                                     top_k=top_k, seed=100 + i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    return runner.generate(seqs)


@pytest.fixture(scope="module", params=SAMPLED, ids=[f"T{t}-p{p}-k{k}" for t, p, k in SAMPLED])
def seeded_reference(request, llm, identity_prompts):
    """Seeded full decoding of the identity prompts, batched: the text every seeded run must give."""
    return request.param, [o.token_ids for o in _seeded(llm.loaded, identity_prompts, "full", *request.param)]


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_seeded_vericache_equals_seeded_full_decoding(llm, identity_prompts, seeded_reference, spec):
    """Coupled sampling: drafter and verifier add the same Gumbel noise g(seed, position), so a seeded
    request's text is seeded full decoding's, bit for bit, for every compressor, at an adaptive and a
    fixed draft length (the rounds differ, the text does not), with drafts really rejected."""
    sampled, reference = seeded_reference
    drafted = accepted = 0
    for draft_len in ("auto", 3):
        outs = _seeded(llm.loaded, identity_prompts, "vericache", *sampled, compressor=spec, draft_len=draft_len)
        assert [o.token_ids for o in outs] == reference, draft_len
        drafted += sum(o.stats["drafted_tokens"] for o in outs)
        accepted += sum(o.stats["accepted_tokens"] for o in outs)
    # int8's error rarely flips even a sample (as in LOSSY_SPECS); every other store had drafts rejected
    assert 0 < accepted < drafted or (spec.startswith("int8") and 0 < accepted == drafted)


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.1", "kivi:bits=2", "streaming:ratio=0.1+kivi:bits=2"])
def test_seeded_vericache_with_a_draft_vocabulary_equals_seeded_full_decoding(llm, identity_prompts,
                                                                              seeded_reference, spec):
    """Coupled sampling with drafts over the first 256 tokens: a sampled draft never proposes a
    token past them (or its prompt's), verification samples over all, and the text is seeded full
    decoding's; under the rejection rule (whose q is then the draft vocabulary's distribution) every
    request still ends with its tokens."""
    sampled, reference = seeded_reference
    outs = _seeded(llm.loaded, identity_prompts, "vericache", *sampled, compressor=spec, draft_len=3, draft_vocab=256)
    assert [o.token_ids for o in outs] == reference
    assert 0 < sum(o.stats["accepted_tokens"] for o in outs) < sum(o.stats["drafted_tokens"] for o in outs)
    rejection = _seeded(llm.loaded, identity_prompts, "vericache", *sampled, compressor=spec, draft_len=3,
                        draft_vocab=256, acceptance="rejection")
    assert [len(o.token_ids) for o in rejection] == [MAX_TOKENS] * len(identity_prompts)
    assert all(0 <= t < llm.loaded.config.vocab_size for o in rejection for t in o.token_ids)


@pytest.fixture(scope="module")
def q8qk_tiny():
    from vericache.model.loader import load_model

    return load_model("tiny", device="cpu", dtype="float32", numerics="q8qk")


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_seeded_vericache_equals_seeded_full_decoding_in_q8qk(q8qk_tiny, identity_prompts, spec):
    """The same under q8qk (attention in integer dots, keys and queries in the model's key coding): the
    verification's rows and full decoding's are coded alike, so seeded text is full decoding's for every
    compressor."""
    sampled = SAMPLED[0]
    reference = [o.token_ids for o in _seeded(q8qk_tiny, identity_prompts, "full", *sampled)]
    outs = _seeded(q8qk_tiny, identity_prompts, "vericache", *sampled, compressor=spec, draft_len=3)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats["drafted_tokens"] for o in outs) > 0


def test_seeded_text_does_not_follow_the_draft_length_under_load(llm, identity_prompts):
    """``draft_len=auto`` takes its rounds from measured step times: with a busy thread beside the engine
    they change, the seeded text does not."""
    import threading

    sampled = SAMPLED[0]
    quiet = _seeded(llm.loaded, identity_prompts[:2], "vericache", *sampled, compressor="snapkv:ratio=0.1")
    stop = threading.Event()

    def busy() -> None:
        x = torch.randn(256, 256)
        while not stop.is_set():
            x = (x @ x).tanh()

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    try:
        loaded_runs = [_seeded(llm.loaded, identity_prompts[:2], "vericache", *sampled, compressor="snapkv:ratio=0.1",
                               draft_len=k) for k in ("auto", 1, 7)]
    finally:
        stop.set()
        worker.join()
    for outs in loaded_runs:
        assert [o.token_ids for o in outs] == [o.token_ids for o in quiet]
    assert len({tuple(o.stats["rounds"] for o in outs) for outs in loaded_runs}) > 1   # the rounds did differ


def test_seeded_identity_catches_order_dependent_noise(llm, identity_prompts, monkeypatch):
    """The negative control: noise drawn in call order (a stateful generator, as before coupled
    sampling) makes seeded VeriCache differ from seeded full decoding, so the test above can fail."""
    import itertools

    import vericache.sampling as sampling
    from vericache.noise import gumbel

    calls = itertools.count()
    monkeypatch.setattr(sampling, "gumbel", lambda seed, stream, positions, n:
                        gumbel(seed + next(calls), stream, positions, n))
    sampled = SAMPLED[0]
    full = _seeded(llm.loaded, identity_prompts, "full", *sampled)
    veri = _seeded(llm.loaded, identity_prompts, "vericache", *sampled, compressor="snapkv:ratio=0.1", draft_len=4)
    assert [o.token_ids for o in veri] != [o.token_ids for o in full]
