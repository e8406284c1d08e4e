"""Model configuration read from a Hugging Face ``config.json``.

Only the fields the Llama-family forward needs are kept. Anything we do not
support is refused here, with the offending field named, so that the forward
never meets a config it cannot honour.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# "freq_factors": each RoPE frequency divided by its factor in ``rope_scaling["freq_factors"]`` [D/2], as
# llama.cpp stores Llama-3 scaling in a GGUF file (its ``rope_freqs`` tensor, the llama3 rule precomputed)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class ModelConfigError(ValueError):
    """A model directory or its config.json cannot be used."""


@dataclass
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v bias (Qwen2 has it; o_proj never does)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral/Qwen2 field; refused when it would bite
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r} in config.json 'architectures'; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim <= 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"config.json field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"unsupported rope_scaling type {rope_type!r} in config.json; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factors = (self.rope_scaling or {}).get("freq_factors")
        if rope_type == "freq_factors" and (not isinstance(factors, list) or len(factors) != self.head_dim // 2):
            raise ModelConfigError(f"rope_scaling 'freq_factors' must list head_dim/2 = {self.head_dim // 2} numbers")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def context_limit(self) -> int:
        """Positions a request may use: the model's, inside its sliding window (we attend densely)."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Bytes of K and V for one position over all layers, at ``itemsize`` bytes per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    def num_parameters(self) -> int:
        """Weights of the forward: embeddings, per-layer attention/MLP/norms, final norm, untied head."""
        h, d, hq, hkv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = h * hq * d * 2 + h * hkv * d * 2 + (hq * d + 2 * hkv * d if self.attention_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' field")
        arch = archs[0]
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # transformers >= 5 writes "rope_parameters" (theta inside); older files use rope_theta + rope_scaling
        rope = dict(raw.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else raw.get("rope_scaling")
        use_sliding = raw.get("use_sliding_window", arch == "MistralForCausalLM")
        window = raw.get("sliding_window") if use_sliding else None
        try:
            return cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                head_dim=raw.get("head_dim") or 0,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
                rope_theta=theta,
                rope_scaling=scaling,
                attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
                qk_norm=arch == "Qwen3ForCausalLM",
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                sliding_window=window,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos_ids,
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"model config not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"corrupt model config {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"corrupt model config {path}: expected a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face loader (and ours) reads back."""
        d = asdict(self)
        arch = d.pop("architecture")
        d["architectures"] = [arch]
        d["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}[arch]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        if d["sliding_window"] is None:
            d.pop("sliding_window")
        return d
