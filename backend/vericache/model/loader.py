"""Load a model (a name, a Hugging Face directory or a GGUF file): config, weights, tokenizer, EOS ids."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from vericache.config import ModelConfig, ModelConfigError
from vericache.kernels.linear_op import linear_numerics, linear_op, score_unit
from vericache.model import exact_linear, native_step
from vericache.model.checkpoint_files import weight_files
from vericache.model.gguf_file import dense_matrices, load_stored
from vericache.model.key_coding import set_key_coding
from vericache.model.llama import Transformer, rope_inv_freq
from vericache.model.registry import resolve_model
from vericache.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def kv_dtype_for(weights: torch.dtype, device: torch.device) -> torch.dtype:
    """Attention dtype: the weights' on accelerators; fp32 on CPU, where fp32 attention is the fast one."""
    return torch.float32 if device.type == "cpu" else weights


def parse_kv_dtype(kv_dtype: str | torch.dtype | None, weights: torch.dtype, device: torch.device) -> torch.dtype:
    """What the full KV caches hold. Default: fp16 on the CPU, as llama.cpp keeps its cache (half the
    bytes every full step and verification reads; attention still computes in fp32); the weights'
    dtype on accelerators."""
    if kv_dtype is None:
        return torch.float16 if device.type == "cpu" else weights
    dt = parse_dtype(kv_dtype, device)   # names as --dtype takes them; a torch.dtype as it is
    if dt not in DTYPES.values():
        raise ValueError(f"KV dtype must be one of {', '.join(DTYPES)}, got {kv_dtype!r}")
    return dt


def load_state_dict(model_dir: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but those named in ``skip`` (read from elsewhere)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                state.update({k: fh.get_tensor(k) for k in fh.keys() if k not in skip})
        except FileNotFoundError:
            raise ModelConfigError(f"weight shard missing: {f}") from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelConfigError(f"corrupt weight file {f}: {exc}") from None
    return state


def read_eos_ids(model_dir: Path, cfg: ModelConfig) -> list[int]:
    """EOS ids from generation_config.json when present (it wins, as in transformers), else config.json."""
    gen = model_dir / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"corrupt {gen}: {exc}") from None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return list(cfg.eos_token_id)


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype          # the weights'
    name: str = ""  # what the user asked for: a model name, a directory or a .gguf file
    kv_dtype: torch.dtype = torch.float32   # what the KV caches hold, full and compressed (``parse_kv_dtype``)
    kernels: str = "native"                  # what the forward runs on (``parse_kernels``)
    numerics: str = "fp32"                   # the forward's arithmetic (``parse_numerics``)
    # [Calibration] once timed (``drafting.calibrate.model_calibration``): every engine over this
    # model shares one calibration
    calibration: list = field(default_factory=list, repr=False, compare=False)

    @property
    def key_codes(self) -> bool:
        """Whether its full caches keep their keys' integer-score codes (the q8qk numerics' attention)."""
        return self.numerics == "q8qk"

    @property
    def linears_q8(self) -> bool:
        """Whether its linears run the q8 op (the q8 and q8qk numerics): q8 draft copies would be the same."""
        return self.numerics in ("q8", "q8qk")

    @property
    def numerics_id(self) -> str:
        """The numerics, and for q8qk a digest of the key coding measured at load (``model.key_coding``):
        what kept key codes were made under (a prefill kept on disk is keyed by it)."""
        if not self.key_codes:
            return self.numerics
        import hashlib

        digest = hashlib.sha256()
        for block in self.model.model.blocks():
            coding = block.self_attn.key_coding
            digest.update(b"" if coding is None else coding.cpu().numpy().tobytes())
        return f"{self.numerics}:{digest.hexdigest()[:16]}"

    @property
    def attn_dtype(self) -> torch.dtype:
        """What attention computes in (``kv_dtype_for``); the caches hold ``kv_dtype``."""
        return self.model.attn_dtype or self.dtype


def load_model(name_or_path: str | Path, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, kv_dtype: str | torch.dtype | None = None,
               kernels: str | None = None, numerics: str | None = None) -> LoadedModel:
    """``kv_dtype``: the full KV caches' (``parse_kv_dtype``). ``kernels`` (``parse_kernels``; default
    $VERICACHE_KERNELS or "auto"): on the CPU ("native") every linear runs the batch-invariant op
    (``model/exact_linear.py``) and a step runs in one native call; a GGUF model's matrices stay in
    their blocks (fp32 only: its dequantized values are fp32), its ``nn.Linear`` modules and embedding
    hold no data. "triton": the linears and the attention on the Triton kernels (``kernels/triton_*.py``;
    a CUDA device's default, or on CPU tensors under TRITON_INTERPRET=1: the dry run); "torch": PyTorch's
    kernels (cuBLAS, SDPA), the fallback on a GPU. ``numerics`` (``parse_numerics``): the native
    linears' arithmetic, q8 or fp32."""
    path = resolve_model(name_or_path)
    dev = torch.device(device) if device is not None else default_device()
    kernels = parse_kernels(kernels, dev)
    dt = parse_dtype(dtype, dev)
    kv_dt = parse_kv_dtype(kv_dtype, dt, dev)
    cfg = ModelConfig.from_file(path / "config.json")
    stored = load_stored(path) if dev.type == "cpu" and dt == torch.float32 and kernels != "torch" else {}
    numerics = parse_numerics(numerics, kernels, dt, stored)
    with torch.device("meta"):
        model = Transformer(cfg)
    for name in stored:   # data-less placeholders: the op reads the blocks
        module, _, field = name.rpartition(".")
        setattr(model.get_submodule(module), field, torch.nn.Parameter(torch.empty(0), requires_grad=False))
    model = model.to_empty(device="cpu")
    state = load_state_dict(path, skip=frozenset(stored))
    if not stored:   # a GGUF model off the blocks path (CUDA, PyTorch's kernels): its matrices dequantized here
        state.update(dense_matrices(path, skip=frozenset(state)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        model.lm_head.weight = model.model.embed_tokens.weight
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in stored and not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelConfigError(
            f"weights in {path} do not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model = prepare(model.to(device=dev, dtype=dt).eval(), dev, dt, kernels, stored, numerics)
    tokenizer = Tokenizer(path / "tokenizer.json", read_eos_ids(path, cfg))
    loaded = LoadedModel(path, cfg, model, tokenizer, dev, dt, str(name_or_path), kv_dt, kernels, numerics)
    if loaded.key_codes:   # q8qk codes keys and queries in a key coding measured on the model itself
        set_key_coding(model, tokenizer, cfg, dev)
    return loaded


def parse_numerics(numerics: str | None, kernels: str, dtype: torch.dtype, stored: dict) -> str:
    """The forward's arithmetic: "q8" (int8 activations in exact integer dot products with the stored
    codes, ``kernels/linear_q8.cpp``), "q8qk" (q8, and attention scores as integer dots of int8 queries
    and keys, ``kernels/int_scores.h``) or "fp32" (exact dequantization, ``kernels/linear.cpp``); each
    batch-invariant and the same bits in every build. None: $VERICACHE_NUMERICS where the native
    kernels run fp32 weights (q8's only home), else auto (``linear_op.default_numerics``): q8qk where
    they run a model stored in integer blocks (a GGUF file), else fp32. q8 on a float checkpoint reads its linears as Q8_0 blocks. The
    GPU kernels compute in their own dtype: fp32 names them."""
    from vericache.kernels.linear_op import NUMERICS, Q8_FORMATS, default_numerics

    native_fp32 = kernels == "native" and dtype == torch.float32
    if numerics is None and native_fp32:
        numerics = os.environ.get("VERICACHE_NUMERICS") or None
    if numerics is not None and numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)} or None (auto), got {numerics!r}")
    if numerics in ("q8", "q8qk") and not native_fp32:
        raise ValueError(f"numerics={numerics!r} runs on the native CPU kernels with fp32 weights, not "
                         f"kernels={kernels!r} dtype={dtype}")
    if numerics is None:
        numerics = default_numerics(native_fp32 and any(w.fmt in Q8_FORMATS for w in stored.values()))
    return numerics


def load_tokenizer(name_or_path: str | Path) -> tuple[Tokenizer, ModelConfig]:
    """A model's tokenizer and config without its weights (a front end that only validates and counts
    tokens: the gateway in front of a Triton server)."""
    path = resolve_model(name_or_path)
    cfg = ModelConfig.from_file(path / "config.json")
    return Tokenizer(path / "tokenizer.json", read_eos_ids(path, cfg)), cfg


def prepare(model: Transformer, dev: torch.device, dt: torch.dtype, kernels: str,
            stored: dict | None = None, numerics: str = "fp32") -> Transformer:
    """A model's weights in place -> ready to run on ``kernels`` (``parse_kernels``'s result): RoPE
    frequencies (fp32 whatever the weights are), fused projections, and the linears and attention on
    the chosen kernels (``stored``: a GGUF model's blocks)."""
    model.inv_freq = rope_inv_freq(model.config).to(dev)
    model.attn_dtype = kv_dtype_for(dt, dev)
    model.fuse_projections()
    if kernels == "native":
        op = linear_op()
        exact_linear.install(model, op, stored, linear_numerics(numerics))
        unit = score_unit(numerics, op.isa)
        for layer in model.model.blocks():
            attn = layer.self_attn
            attn.kernels, attn.score_unit = kernels, unit
            if unit:   # q8qk: its key coding, none (offsets 0, scales 1) until measured (``model.key_coding``)
                attn.key_coding = torch.stack([torch.zeros(attn.n_kv, attn.head_dim, device=dev),
                                               torch.ones(attn.n_kv, attn.head_dim, device=dev)])
        native_step.install(model, op, unit)
        return model
    return use_gpu_kernels(model, kernels, stored)


def use_gpu_kernels(model: Transformer, kernels: str, stored: dict | None = None) -> Transformer:
    """Put a prepared model's linears and attention on "triton" or "torch" (PyTorch's: the modules'
    weights), in place: the GPU check times both kernel sets on one model."""
    if kernels not in ("triton", "torch"):
        raise ValueError(f"the GPU kernels are triton or torch, got {kernels!r}")
    if kernels == "triton":
        from vericache.kernels.triton_linear import TritonLinear

        exact_linear.install(model, TritonLinear(), stored)
    elif stored or not model.lm_head.weight.numel():
        raise ValueError("PyTorch's kernels need the weights in the modules; this model keeps them as stored blocks")
    else:
        exact_linear.uninstall(model)
    for layer in model.model.blocks():
        layer.self_attn.kernels = kernels
    return model


KERNELS = ("auto", "native", "triton", "torch")


def parse_kernels(kernels: str | None, dev: torch.device) -> str:
    """What the forward runs on: "native" (the CPU's batch-invariant ops), "triton" or "torch"; "auto"
    (the default, or $VERICACHE_KERNELS) picks native on the CPU and Triton on a GPU when it imports."""
    kernels = kernels or os.environ.get("VERICACHE_KERNELS") or "auto"
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "native" and dev.type != "cpu":
        raise ValueError(f"the native kernels run on the CPU, not on {dev}")
    if kernels == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton kernels run on CPU tensors only in Triton's interpreter: start with "
                         "TRITON_INTERPRET=1 (a dry run), or use a CUDA device")
    if kernels == "auto":
        if dev.type == "cpu":
            return "native"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return kernels
