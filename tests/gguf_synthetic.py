"""Small random models written as GGUF files the way llama.cpp's converter writes them (the tests'
inputs; transformers reading the same file is the reference)."""

from __future__ import annotations

import numpy as np

# byte offsets of the fp16 scales inside one K-quant block (d, dmin) and the block size
K_SCALES = {"Q4_K": ((0, 2), 144), "Q5_K": ((0, 2), 176), "Q6_K": ((208,), 210)}


def byte_vocab() -> list[str]:
    """The byte-level alphabet (every byte one token), as a "gpt2" vocabulary starts."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K permutation for Llama files (what our loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with small finite scales (numpy has no K-quant quantizer): [rows, bytes]."""
    offsets, size = K_SCALES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off in offsets:  # fp16 scale 0.01: finite, small
        blocks[:, :, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def add_matrix(writer, name: str, value: np.ndarray, kind: str, rng) -> None:
    """Write the fp32 matrix ``value`` as ``kind`` (K-quants: random blocks of that format instead)."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, value)
    elif kind in K_SCALES:
        writer.add_tensor(name, k_quant_blocks(kind, *value.shape, rng), raw_dtype=qtype)
    else:
        q = quantize(value, qtype)
        writer.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)
