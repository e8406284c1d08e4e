"""GGUF files (llama.cpp's format) turned into a Hugging Face directory our loader reads.

A GGUF file holds quantized weights, the model's hyperparameters as ``<arch>.*`` metadata (llama, qwen2, qwen3) and
its tokenizer as ``tokenizer.ggml.*`` arrays. We read it with the ``gguf`` package, undo the Q/K row
permutation llama.cpp applies to Llama attention weights (not Qwen2's), and write config.json, the weights,
tokenizer.json and tokenizer_config.json into a cache directory keyed by the file's SHA-256, so the second
load is a safetensors mmap (well under a second) and every process (gateway, Triton stub, benches) shares
one conversion. ``stored.safetensors`` keeps every matrix (the linears and the embedding) in its GGUF blocks, rows in
Hugging Face order: what the CPU forward reads through the batch-invariant linear op (``load_stored``);
other paths (CUDA, PyTorch's kernels) dequantize them at load (``dense_matrices``). ``rest.safetensors``
holds the other tensors (norms, biases) in fp32. No fp32 copy of the matrices is written: the cache
costs the GGUF file's size (transformers comparisons read the GGUF file itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from vericache.config import ModelConfigError

# the ggml types we dequantize (all through gguf.quants.dequantize)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# GGUF architecture -> (Hugging Face architecture, model_type, whether llama.cpp permuted the Q/K rows:
# its converter interleaves each head's RoPE halves for Llama only). Mistral 7B's files are ``llama``
# files with a SentencePiece vocabulary; Llama 3.x ones carry their RoPE scaling as a ``rope_freqs``
# tensor (``_rope_freq_factors``).
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
                      "qwen3": ("Qwen3ForCausalLM", "qwen3", False)}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
STORED_FILE = "stored.safetensors"   # the matrices in their GGUF blocks (``stored_state``)
REST_FILE = "rest.safetensors"       # every other tensor (norms, biases) in fp32 (``unstored_state``)
# llama.cpp tensor names -> Hugging Face Llama names (per block: blk.<i>.<part>.weight)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",   # Qwen3's per-head norms
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def cache_root() -> Path:
    """Where converted models live: $VERICACHE_CACHE_DIR, else $XDG_CACHE_HOME/vericache, else ~/.cache/vericache."""
    if os.environ.get("VERICACHE_CACHE_DIR"):
        return Path(os.environ["VERICACHE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vericache"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_to_hf_dir(path: str | Path, root: Path | None = None) -> Path:
    """The Hugging Face directory converted from the GGUF file at ``path`` (converting on first use)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelConfigError(f"GGUF file not found: {path}")
    out = (root or cache_root()) / "gguf" / file_sha256(path)[:24]
    if (out / STORED_FILE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        write_hf_dir(path, tmp)
        # readable by all, as a model cache is: mkdtemp's 0700 and the weights' temp files' 0600 would hide a
        # shared cache (an image's, converted as root at build time) from the user it serves as
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(out)  # atomic: a concurrent converter that won the race leaves us its copy
        except OSError:
            if not (out / STORED_FILE).exists():   # a conversion from before stored blocks existed: replace it
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def describe_file(path: str | Path) -> dict:
    """What a GGUF file holds, read from its header (nothing converted): ``vericache models --path``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelConfigError(f"GGUF file not found: {path}")
    reader = _reader(path)
    value = reader.meta.get

    arch = value("general.architecture")
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    unsupported = sorted(set(types) - set(SUPPORTED_TENSOR_TYPES))
    return {"path": str(path), "name": value("general.name"), "architecture": arch,
            "blocks": value(f"{arch}.block_count"), "context_length": value(f"{arch}.context_length"),
            "hidden_size": value(f"{arch}.embedding_length"), "heads": value(f"{arch}.attention.head_count"),
            "kv_heads": value(f"{arch}.attention.head_count_kv"), "tokenizer": value("tokenizer.ggml.model"),
            "parameters": sum(int(t.n_elements) for t in reader.tensors), "size_bytes": path.stat().st_size,
            "tensor_types": types, "chat_template": value("tokenizer.chat_template") is not None,
            "supported": arch in SUPPORTED_GGUF_ARCHITECTURES and not unsupported,
            "unsupported_tensor_types": unsupported}


def _reader(path: Path):
    """The file's metadata and tensors (``gguf_reader.read_gguf``); a corrupt file is a ModelConfigError."""
    try:
        import gguf  # noqa: F401  (block sizes and dequantization)
    except ImportError:
        raise ModelConfigError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
    from vericache.model.gguf_reader import read_gguf

    try:
        return read_gguf(path)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"corrupt GGUF file {path}: {exc}") from None


def hf_config(meta: dict) -> dict:
    """config.json fields from ``<arch>.*`` metadata (``GGUF_ARCHITECTURES``; Qwen2's q/k/v biases are
    implied by its architecture, its untied ``output.weight`` kept)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelConfigError(f"unsupported GGUF architecture {arch!r}; supported: "
                               f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]], "model_type": GGUF_ARCHITECTURES[arch][1], "hidden_act": "silu",
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", get("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False   # GGUF has no window: Qwen attends densely
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelConfigError(f"unsupported GGUF rope scaling {scaling!r}; supported: linear")
    return cfg


def _permuted_heads(cfg: dict, name: str) -> int:
    """The heads whose rows llama.cpp permuted in the matrix ``name`` (0: none; ``GGUF_ARCHITECTURES``)."""
    if not next(p for hf, _, p in GGUF_ARCHITECTURES.values() if hf == cfg["architectures"][0]):
        return 0
    if name.endswith("q_proj.weight"):
        return cfg["num_attention_heads"]
    return cfg["num_key_value_heads"] if name.endswith("k_proj.weight") else 0


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: it interleaves each head's two RoPE halves (w: [n_head*D, H])."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_type(t) -> None:
    if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
        raise ModelConfigError(f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name}); supported: "
                               f"{', '.join(SUPPORTED_TENSOR_TYPES)}")


def unstored_state(reader) -> dict[str, torch.Tensor]:
    """Every tensor but the matrices (the norms' weights, the q/k/v biases: 1-D), dequantized to fp32,
    under its Hugging Face name: ``REST_FILE``."""
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        _check_type(t)
        name = _hf_name(t.name)
        if name is None or len(t.shape) == 2:
            continue  # rope_freqs: in the config (``_rope_freq_factors``); matrices: ``stored_state``
        state[name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1))
    return state


def stored_state(reader, cfg: dict) -> dict[str, tuple[str, int, torch.Tensor]]:
    """Every matrix as stored: Hugging Face name -> (ggml type, columns, uint8 [rows, row bytes]), Q/K rows
    unpermuted (a row permutation moves whole block rows, so the blocks stay as they are)."""
    out = {}
    for t in reader.tensors:
        _check_type(t)
        name = _hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        rows = int(t.shape[1])
        data = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1).copy())
        if heads := _permuted_heads(cfg, name):
            data = unpermute_qk(data, heads).contiguous()
        out[name] = (t.tensor_type.name, int(t.shape[0]), data)
    return out


def stored_formats(model_dir: Path) -> set[str]:
    """The GGUF block formats a converted model's stored matrices are in (read from the header); empty
    for other models."""
    from safetensors import safe_open

    path = Path(model_dir) / STORED_FILE
    if not path.exists():
        return set()
    with safe_open(str(path), framework="pt") as f:
        return {json.loads(v)[0] for v in (f.metadata() or {}).values()}


def load_stored(model_dir: Path) -> dict:
    """The stored matrices of a converted GGUF model (``StoredWeight`` by name); {} for other models."""
    from safetensors import safe_open

    from vericache.kernels.linear_op import StoredWeight

    path = Path(model_dir) / STORED_FILE
    if not path.exists():
        return {}
    out = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for name in f.keys():
            fmt, k = json.loads(meta[name])
            data = f.get_tensor(name)
            out[name] = StoredWeight(fmt, data, data.shape[0], k)
    return out


def dense_matrices(model_dir: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The stored matrices not named in ``skip``, dequantized to fp32 [rows, columns] (what a load that does
    not read blocks takes: CUDA, PyTorch's kernels, bf16); {} for other models."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = {}
    for name, w in load_stored(model_dir).items():
        if name in skip:
            continue
        if w.data.dtype != torch.uint8:   # F32/F16/BF16 matrices held as themselves
            out[name] = w.data.float().reshape(w.n, w.k)
        else:   # blocks dequantize row by row: [n, row bytes] -> [n, k]
            values = dequantize(w.data.numpy(), GGMLQuantizationType[w.fmt])
            out[name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(w.n, w.k))
    return out


def _rope_freq_factors(reader) -> list[float] | None:
    """The ``rope_freqs`` tensor [D/2] (llama.cpp divides each RoPE frequency by its factor: Llama 3.x's
    scaling precomputed by its converter, whose parameters the file does not keep), or None."""
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    return [float(f) for f in np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)]


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        return None
    raise ModelConfigError(f"unexpected tensor {name!r} in GGUF file")


def write_hf_dir(path: Path, out: Path) -> None:
    """Convert the GGUF file at ``path`` into a Hugging Face directory ``out``."""
    from safetensors.torch import save_file

    from vericache.model.gguf_tokenizer import build_tokenizer

    reader = _reader(path)
    meta = reader.meta
    cfg = hf_config(meta)
    if (factors := _rope_freq_factors(reader)) is not None:
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors}
    tokenizer, tok_cfg = build_tokenizer(meta)
    stored = stored_state(reader, cfg)
    # no fp32 copy of the matrices: the CPU forward reads their blocks, other paths dequantize them at load
    # (``dense_matrices``), so the cache is the GGUF file's size, not four to eight times it
    cfg["tie_word_embeddings"] = "lm_head.weight" not in stored
    save_file(unstored_state(reader), str(out / REST_FILE))
    save_file({n: d for n, (_, _, d) in stored.items()}, str(out / STORED_FILE),
              metadata={n: json.dumps([fmt, k]) for n, (fmt, k, _) in stored.items()})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (out / "source.json").write_text(json.dumps({"gguf": str(path), "name": meta.get("general.name"),
                                                 "license": meta.get("general.license"),
                                                 "file_type": meta.get("general.file_type")}, indent=1))
