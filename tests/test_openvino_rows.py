"""The benches' OpenVINO GenAI rows (``vericache_lab.bench.openvino_bench``): an optional extra, so the
rows are left out with their reason where it is not installed, and run for real where it is."""

from __future__ import annotations

import pytest

from vericache_lab.bench import openvino_bench


def test_the_variants_keep_what_our_compressor_keeps_in_whole_blocks():
    rows = openvino_bench.variants(1000, 8000)
    assert list(rows) == ["OpenVINO GenAI (defaults: u8 KV)", "OpenVINO GenAI (f16 KV)",
                          "OpenVINO GenAI (its eviction, 992 of 8000 tokens kept; lossy)"]
    assert rows["OpenVINO GenAI (f16 KV)"] == {"kv": "f16"} and list(rows.values())[2] == {"evict": 992}
    assert openvino_bench.variants(20, 300)[next(k for k in openvino_bench.variants(20, 300) if "eviction" in k)] == {
        "evict": 6 * openvino_bench.KV_BLOCK}                                     # never below its start + recent blocks
    assert len(openvino_bench.variants(None, 4000)) == 2                        # a quantizer evicts nothing: no eviction row


def test_without_openvino_the_rows_are_left_out_with_the_reason(monkeypatch):
    monkeypatch.setattr(openvino_bench, "unavailable", lambda: "openvino-genai is not installed (pip install -e '.[openvino]')")
    said = []
    assert openvino_bench.rows("smollm2-135m", [[1, 2, 3]], 4, "snapkv:ratio=0.125", None, said.append) == []
    assert said == ["OpenVINO GenAI: openvino-genai is not installed (pip install -e '.[openvino]'); no OpenVINO GenAI rows"]
    said.clear()
    monkeypatch.setattr(openvino_bench, "unavailable", lambda: None)
    assert openvino_bench.rows("tiny", [[1, 2, 3]], 4, "snapkv:ratio=0.125", None, said.append) == []
    assert said == ["OpenVINO GenAI: tiny has no GGUF file; no OpenVINO GenAI rows"]


def test_openvino_rows_run_on_the_default_models_gguf(smollm):
    """Where openvino-genai is installed: its three rows on a real prompt, each with its decode speed,
    and its f16-KV greedy text compared with our full mode's."""
    why = openvino_bench.unavailable()
    if why is not None:
        pytest.skip(why)
    from vericache import SamplingParams
    from vericache_lab.bench.common import code_prompt

    prompt = code_prompt(smollm.tokenizer, 400)
    engine = smollm.engine
    ours = engine.generate([engine.new_sequence(0, prompt, SamplingParams(max_tokens=8, ignore_eos=True))], "full")[0]
    rows = openvino_bench.rows("smollm2-135m", [prompt], 8, "snapkv:ratio=0.125", [ours.token_ids], print)
    assert [r["mode"] for r in rows] == list(openvino_bench.variants(50, 400))
    assert all(r["tokens_per_s"] > 0 and r["first_token_s"] > 0 and isinstance(r["identical_to_full"], bool) for r in rows)
