"""The packed attention op: right (against float64 masked attention and the per-part torch path),
batch-invariant bit for bit, the same bits in every build (AVX-512, AVX2, portable), and bad input refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from vericache.kernels import packed_kernels
from vericache.kernels.cpu import supported_isas
from vericache.kernels.layouts import PART_TENSORS
from vericache.kv.attention import merge
from vericache.kv.packed import KeyPart, attend_packed, op_args, seen_scores, torch_part
from vericache.kv.quantized import CHANNEL_GROUPS, FP8, TOKEN_GROUPS, Layout

HQ, HKV, D = 9, 3, 64


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)


def _q(t: int, seed: int) -> torch.Tensor:
    return torch.randn(HQ, t, D, generator=torch.Generator().manual_seed(seed))


def _reference(q, keys, values, start):
    """Causal float64 attention of q (positions start..) over keys 0..start+T-1, GQA expanded."""
    t = q.shape[1]
    k = keys[:, : start + t].repeat_interleave(HQ // HKV, 0).double()
    v = values[:, : start + t].repeat_interleave(HQ // HKV, 0).double()
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)


def test_other_threads_run_while_the_op_attends():
    """The op lets go of the GIL while it runs (``bindings.cpp``; the whole forward too), so a server's
    threads run beside a step: a Python thread beside a long call never stands still for long (held, it
    would stand still for the whole call)."""
    n = 24_000
    k, v = _kv(n, 1)
    for t in (256, 512, 1024, 2048):   # rows enough for a call long enough to tell, on this machine
        q, parts = _q(t, 2), [[KeyPart(k, v, n=n, diag=n - t)]]
        alone = []
        for _ in range(2):
            t0 = time.perf_counter()
            attend_packed(q, [t], parts, HKV)
            alone.append(time.perf_counter() - t0)
        if min(alone) > 0.06:
            break
    worker = threading.Thread(target=attend_packed, args=(q, [t], parts, HKV))
    marks = [time.perf_counter()]
    worker.start()
    while worker.is_alive():
        marks.append(time.perf_counter())
    worker.join()
    longest_stall = max(b - a for a, b in zip(marks, marks[1:]))
    assert min(alone) > 0.06, "the call is too short to tell"
    assert longest_stall < min(alone) / 2, f"the other thread stood still {longest_stall:.3f} s of a {min(alone):.3f} s call"


@pytest.mark.parametrize("start, t", [(0, 1), (0, 7), (37, 1), (63, 2), (130, 33), (511, 3), (1100, 17)])
def test_causal_part_equals_masked_attention(start, t):
    k, v = _kv(start + t + 5, start + t)
    q = _q(t, start)
    out = attend_packed(q, [t], [[KeyPart(k, v, n=start + t, diag=start)]], HKV)       # [T, Hq, D]
    assert out.shape == (t, HQ, D)
    assert torch.allclose(out.transpose(0, 1).double(), _reference(q, k, v, start), atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_build_gives_every_head_size_and_element_type_the_same_bits(dtype):
    """The builds' vectors differ (AVX-512's scores pair two rows in 16 lanes and its values hold 16
    channels; AVX2's 8 lanes; the portable build's scalars), their arithmetic must not: for head sizes 64,
    72 (not a multiple of 16: AVX-512's values fall back to 8 lanes), 80 (16 but not 64: a short last
    stretch) and 128, keys stored as fp32, fp16 or bf16, a decode row (3 rows a KV head: read directly)
    and a 17-row chunk (51: through the widened copy), every build gives the portable build's bits, close
    to float64 attention. The same rows summed in another order (torch's fp32 attention) differ in bits:
    equal bits across builds are a property of the kernel, not of the inputs."""
    gen, n = torch.Generator().manual_seed(5), 150
    for d in (64, 72, 80, 128):
        k, v = (torch.randn(HKV, n, d, generator=gen).to(dtype) for _ in range(2))
        for t in (1, 17):
            q, start = torch.randn(HQ, t, d, generator=gen), n - t
            ints, tensors = op_args(0, KeyPart(k, v, n=n, diag=start), d)
            ref = packed_kernels("portable").attend_packed(q, HKV, [t], ints, tensors)       # [T, Hq, D]
            for isa in supported_isas():
                assert torch.equal(packed_kernels(isa).attend_packed(q, HKV, [t], ints, tensors), ref), (isa, d, t)
            kx, vx = (x.float().repeat_interleave(HQ // HKV, 0) for x in (k, v))
            mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
            exact = F.scaled_dot_product_attention(q.double(), kx.double(), vx.double(), attn_mask=mask)
            torch.testing.assert_close(ref.transpose(0, 1).double(), exact, atol=1e-5, rtol=1e-5)
            other_order = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask).transpose(0, 1)
            assert not torch.equal(other_order, ref)


def test_parts_merge_like_torch_per_part():
    """A store seen whole + a causal residual, beside another sequence: the same as the torch path."""
    store_k, store_v = _kv(700, 1)
    res_k, res_v = _kv(80, 2)
    full_k, full_v = _kv(1500, 3)
    q = _q(4 + 1, 4)
    parts = [[KeyPart(store_k, store_v, n=650), KeyPart(res_k, res_v, n=40 + 4, diag=40)],
             [KeyPart(full_k, full_v, n=1400 + 1, diag=1400)]]
    out = attend_packed(q, [4, 1], parts, HKV)
    for rows, seq_parts in ((slice(0, 4), parts[0]), (slice(4, 5), parts[1])):
        ref = merge([r for p in seq_parts for r in torch_part(q[:, rows], p)])
        assert torch.allclose(out[rows].transpose(0, 1), ref, atol=2e-6)


# every dequantizer path: 2/4/8-bit codes, channel and token groups (>= 16 channels: vectorised; 8: scalar)
LAYOUTS = {"kivi-2": (Layout(CHANNEL_GROUPS, 2, 32), Layout(TOKEN_GROUPS, 2, 32)),
           "kivi-4": (Layout(CHANNEL_GROUPS, 4, 64), Layout(TOKEN_GROUPS, 4, 16)),
           "int4": (Layout(TOKEN_GROUPS, 4, 32),) * 2, "int8": (Layout(TOKEN_GROUPS, 8, 64),) * 2,
           "int4-g8": (Layout(TOKEN_GROUPS, 4, 8),) * 2, "fp8": (Layout(FP8),) * 2}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantized_part_matches_dequantize_then_attend(name):
    layouts, n = LAYOUTS[name], 320
    k, v = _kv(n, 5)
    fields = []
    for layout, x in zip(layouts, (k, v)):
        tok, grp = layout.encode(x)
        fields.append({"tok": tok, "grp": grp})
    q = _q(3, 6)
    part = KeyPart(fields[0], fields[1], n=n - 7, layouts=layouts)
    out = attend_packed(q, [3], [[part]], HKV)
    ref = torch_part(q, part)[0][0]                                 # dequantize, then attend in torch
    assert torch.allclose(out.transpose(0, 1), ref, atol=2e-5)
    ints, tensors = op_args(0, part, q.shape[-1])
    for isa in supported_isas():                                    # every build: the same bits
        assert torch.equal(packed_kernels(isa).attend_packed(q, HKV, [3], ints, tensors), out), isa


def _row_alone(k, v, q, pos, part_extra=None):
    """Row at position ``pos`` decoded alone: a one-query chunk over keys 0..pos."""
    parts = [KeyPart(k, v, n=pos + 1, diag=pos)]
    return attend_packed(q[:, pos : pos + 1], [1], [(part_extra or []) + parts], HKV)[0]


def test_batch_invariant_bit_for_bit():
    """A query row's output depends on its own query, keys and position only: alone, inside chunks of
    1-32 queries, inside steps of 1-16 sequences, with 1 and 2 threads, in every build."""
    n = 1300
    k, v = _kv(n + 40, 7)
    store_k, store_v = _kv(900, 8)
    store = [KeyPart(store_k, store_v, n=777)]
    qall = _q(n + 40, 9)                                   # query of position p: qall[:, p]
    probe = [0, 63, 64, 511, 512, 1023, 1290]
    alone = {p: _row_alone(k, v, qall, p) for p in probe}
    alone_store = {p: _row_alone(k, v, qall, p, store) for p in probe}
    for t in (1, 2, 3, 5, 17, 32):
        for p in probe:
            start = max(0, p - t // 2)                      # p somewhere inside the chunk
            out = attend_packed(qall[:, start : start + t], [t], [[KeyPart(k, v, n=start + t, diag=start)]], HKV)
            assert torch.equal(out[p - start], alone[p]), (t, p)
            out = attend_packed(qall[:, start : start + t], [t],
                                [store + [KeyPart(k, v, n=start + t, diag=start)]], HKV)
            assert torch.equal(out[p - start], alone_store[p]), (t, p)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for n_seqs in (1, 4, 16):
                # sequence j decodes position probe[j % 7] among others with their own chunks
                seq_lens, parts, rows, qs, at = [], [], [], [], 0
                for j in range(n_seqs):
                    p, t = probe[j % len(probe)], 1 + j % 3
                    start = max(0, p - j % t)                  # p is row j % t of its chunk (if it can be)
                    qs.append(qall[:, start : start + t])
                    parts.append([KeyPart(k, v, n=start + t, diag=start)])
                    rows.append((at + p - start, p))
                    seq_lens.append(t)
                    at += t
                out = attend_packed(torch.cat(qs, dim=1), seq_lens, parts, HKV)
                for row, p in rows:
                    assert torch.equal(out[row], alone[p]), (n_threads, n_seqs, p)
    finally:
        torch.set_num_threads(threads)
    for isa in supported_isas():   # the AVX-512, AVX2 and portable builds this CPU runs: the same bits
        op = packed_kernels(isa)
        for p in probe:
            for t in (1, 17):          # a decode row, and a row inside a chunk (the causal diagonal)
                start = max(0, p - t // 2)
                args = op_args(0, KeyPart(k, v, n=start + t, diag=start), D)
                assert torch.equal(op.attend_packed(qall[:, start : start + t], HKV, [t], *args)[p - start],
                                   alone[p]), (isa, p, t)


def test_bad_parts_are_refused():
    k, v = _kv(10, 0)
    q = _q(2, 0)
    with pytest.raises(ValueError, match="seq_lens"):
        attend_packed(q, [3], [[KeyPart(k, v, n=3, diag=0)]], HKV)
    with pytest.raises(ValueError, match="n=-1"):
        KeyPart(k, v, n=-1)
    with pytest.raises(RuntimeError, match=r">= 12"):
        attend_packed(q, [2], [[KeyPart(k, v, n=12, diag=10)]], HKV)   # more keys than the tensors hold
    with pytest.raises(RuntimeError, match="fp32"):
        attend_packed(q, [2], [[KeyPart(k.double(), v.double(), n=2, diag=0)]], HKV)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_half_size_parts_are_their_widened_values(dtype, d):
    """A half-size full KV (fp16/bf16 rows, widened to fp32 inside the op) gives the bits of fp32 parts
    holding the widened values: in every build, for a causal full part beside a store part; the torch
    path (CUDA's) agrees to rounding."""
    g = torch.Generator().manual_seed(11)
    n, t, s = 1100, 5, 1095
    k, v = (torch.randn(HKV, n + 3, d, generator=g).to(dtype) for _ in range(2))
    sk, sv = (torch.randn(HKV, 300, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(HQ, t, d, generator=g)
    half = [KeyPart(sk, sv, n=290), KeyPart(k, v, n=n, diag=s)]
    wide = [KeyPart(sk.float(), sv.float(), n=290), KeyPart(k.float(), v.float(), n=n, diag=s)]
    ref = attend_packed(q, [t], [wide], HKV)
    ints, tensors = [], []
    for p in half:
        i, ts = op_args(0, p, d)
        ints, tensors = ints + i, tensors + ts
    for isa in supported_isas():
        assert torch.equal(packed_kernels(isa).attend_packed(q, HKV, [t], ints, tensors), ref), isa
    torch_out = merge([r for p in half for r in torch_part(q, p)]).transpose(0, 1)
    torch.testing.assert_close(torch_out, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="alike"):
        attend_packed(q, [t], [[KeyPart(k, v.float(), n=n, diag=s)]], HKV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("start, t", [(0, 5), (600, 1), (1100, 17)])
def test_seen_scores_record_what_the_rows_attended(dtype, start, t):
    """The optional ``seen`` output (a guided drafter's signal): each key's max scaled score over each
    query head's rows that see it, as the float64-free torch reference says, in every build; it
    changes no bit of the attention itself."""
    k, v = _kv(start + t + 9, start + 3)
    k, v = k.to(dtype), v.to(dtype)
    q = _q(t, start + 1)
    plain = KeyPart(k, v, n=start + t, diag=start)
    out = attend_packed(q, [t], [[plain]], HKV)
    seen = torch.full((HQ, start + t + 9), 7.0)
    part = KeyPart(k, v, n=start + t, diag=start, seen=seen)
    assert torch.equal(attend_packed(q, [t], [[part]], HKV), out)
    ref = seen_scores(q, part)
    assert torch.allclose(seen[:, : start + t], ref, atol=1e-5)
    assert torch.all(seen[:, start + t :] == 7.0)                  # nothing past n is written
    if t > 1:                                                      # the chunk's own keys: only later rows see them
        assert seen[0, start + t - 1] == pytest.approx(ref[0, start + t - 1].item(), abs=1e-5)
    ints, tensors = op_args(0, part, D)
    for isa in supported_isas():
        again = torch.zeros_like(seen)
        tensors[PART_TENSORS.index("seen")] = again
        packed_kernels(isa).attend_packed(q, HKV, [t], ints, tensors)
        assert torch.equal(again[:, : start + t], seen[:, : start + t]), isa


def test_seen_scores_refuse_a_bad_buffer():
    k, v = _kv(40, 1)
    bad = KeyPart(k, v, n=40, diag=39, seen=torch.zeros(HQ - 1, 40))
    with pytest.raises(RuntimeError, match="seen"):
        attend_packed(_q(1, 2), [1], [[bad]], HKV)
