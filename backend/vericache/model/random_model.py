"""A model of a known architecture's shapes with random weights, built where it runs: what the GPU check
times (Llama-3-8B's shapes, bf16: 16 GB of weights made on the device in a second instead of a
checkpoint crossing the network) and, at toy shapes, what its dry run and the tests decode.

Random weights make a forward's cost real and its outputs meaningless, but still deterministic: full
decoding and VeriCache must agree token for token on them as on any model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from vericache.config import ModelConfig
from vericache.model.llama import Transformer
from vericache.model.loader import LoadedModel, parse_dtype, parse_kernels, parse_kv_dtype, prepare
from vericache.model.tokenizer import Tokenizer

SHAPES: dict[str, dict[str, Any]] = {
    # Meta-Llama-3-8B's config.json (the shapes and RoPE; no weights)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    # the same structure (GQA 2:1) at a size Triton's interpreter runs in seconds: the dry run's
    "toy": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096),
}


def word_tokenizer(vocab_size: int, directory: Path) -> Tokenizer:
    """A tokenizer of ``vocab_size`` words "t0" .. (one id each): the random model's, so that output ids
    decode to text like any model's."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer(path, eos_token_ids=[])


@torch.no_grad()
def random_model(shape: str, device: str | torch.device, dtype: str | torch.dtype | None = None,
                 kernels: str | None = None, seed: int = 0, max_context: int | None = None) -> LoadedModel:
    """``shape`` (a ``SHAPES`` name) with weights ~ N(0, 0.02) (norms 1), made directly on ``device`` in
    ``dtype``, prepared for ``kernels`` as ``load_model`` prepares a checkpoint. ``max_context``: the
    positions it admits (default the architecture's)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    dev = torch.device(device)
    kernels = parse_kernels(kernels, dev)
    dt = parse_dtype(dtype, dev)
    cfg = ModelConfig(**SHAPES[shape] | ({"max_position_embeddings": max_context} if max_context else {}))
    with torch.device("meta"):
        model = Transformer(cfg).to(dt)   # no memory yet: allocated once, on the device, in dt
    model = model.to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model = prepare(model.eval(), dev, dt, kernels)
    workdir = Path(tempfile.mkdtemp(prefix=f"vericache-random-{shape}-"))
    return LoadedModel(workdir, cfg, model, word_tokenizer(cfg.vocab_size, workdir), dev, dt, f"random:{shape}",
                       parse_kv_dtype(None, dt, dev), kernels)
