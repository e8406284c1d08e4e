"""``EngineConfig``: every engine default, written once (nano-vllm's one Config).

``LLM``, ``vericache serve``, the Triton model, the verifier role and every bench build their
engine from one of these; the command line (``add_engine_args``), Triton's config.pbtxt parameters
(``from_parameters``) and keyword arguments (``EngineConfig(**kwargs)`` / ``replace``) are the only
three ways in, and each reads its defaults from the dataclass's fields, so ``--help``, the model
repository and the docs cannot drift from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NoReturn

from vericache.engine.offload import SCHEDULERS
from vericache.engine.options import MODES
from vericache.kernels.linear_op import NUMERICS
from vericache.model.draft_weights import DRAFT_WEIGHTS
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import ACCEPTANCE_RULES

if TYPE_CHECKING:
    from vericache.model.loader import LoadedModel

KV_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    # the model and where it runs
    model: str = DEFAULT_MODEL      # a registry name, a Hugging Face directory or a .gguf file
    device: str | None = None       # None: cuda when present, else cpu
    dtype: str | None = None        # weights; None: bf16 on CUDA, fp32 on the CPU
    kv_dtype: str | None = None     # the full KV; None: float16 on the CPU, the weights' dtype on CUDA
    kernels: str | None = None      # native | triton | torch; None: native on the CPU, Triton on a GPU
    numerics: str | None = None     # the CPU linears': q8 (int8 x the stored codes) | fp32; None: q8 for GGUF integer blocks
    # what a request gets when it asks for nothing
    mode: str = "vericache"
    compressor: str = "snapkv:ratio=0.125"   # a spec (or a ``Compressor``): eviction[+quantization]
    draft_len: int | str = "auto"   # tokens a round, or "auto" (the cost model decides per round)
    draft_weights: str = "auto"     # what drafts read on the CPU: auto (fp32 or q8, measured), fp32, q8, int8, int4
    draft_vocab: int | str = "auto"  # tokens a draft row takes logits for: auto, 0 (all), n (the first n)
    lookup: bool = True             # prompt-lookup proposals checked by the drafter (drafting.lookup)
    acceptance: str = "coupled"     # sampled drafts: coupled (seeded text == full decoding's) | rejection
    # the step loop
    prefill_chunk: int = 512        # prompt tokens a request prefills per step (others wait at most one chunk)
    max_running: int = 64
    max_queue: int = 64             # waiting requests a server accepts before answering 429
    device_budget_gb: float | None = 4.0   # KV the device tier may hold (None: no limit)
    # the full KV in a host tier, brought over a link for each verification (P1). None: only where the
    # device is not the host (CUDA); on the CPU the full KV is already in host memory and verification
    # reads it in place, so every row kind runs the native step
    tiered: bool | None = None
    scheduler: str = "staggered"    # the link schedule when tiered
    resident_layers: int = 0        # tiered: leading layers of the full KV kept on the device

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> NoReturn:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.model, str) or not self.model:
            bad("model", "must be a model name or path")
        if self.mode not in MODES:
            bad("mode", f"must be one of {', '.join(MODES)}")
        if not (isinstance(self.compressor, str) and self.compressor) and not hasattr(self.compressor, "spec"):
            bad("compressor", "must be a spec such as 'snapkv:ratio=0.125' (or a Compressor)")
        if self.draft_len != "auto" and (isinstance(self.draft_len, bool) or not isinstance(self.draft_len, int)
                                         or self.draft_len < 1):
            bad("draft_len", "must be an integer >= 1 or 'auto'")
        if not isinstance(self.lookup, bool):
            bad("lookup", "must be true or false")
        if self.acceptance not in ACCEPTANCE_RULES:
            bad("acceptance", f"must be one of {', '.join(ACCEPTANCE_RULES)}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            bad("draft_weights", f"must be one of {', '.join(DRAFT_WEIGHTS)}")
        if self.draft_vocab != "auto" and (isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                                           or self.draft_vocab < 0):
            bad("draft_vocab", "must be 'auto', 0 (the whole vocabulary) or a token count >= 1")
        if self.numerics is not None and self.numerics not in NUMERICS:
            bad("numerics", f"must be one of {', '.join(NUMERICS)} or None (auto)")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            bad("kv_dtype", f"must be one of {', '.join(KV_DTYPES)}")
        for name in ("prefill_chunk", "max_running", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(name, "must be an integer >= 1")
        if self.device_budget_gb is not None and not (isinstance(self.device_budget_gb, (int, float))
                                                      and self.device_budget_gb > 0):
            bad("device_budget_gb", "must be > 0 GiB or None")
        if self.tiered not in (None, True, False):
            bad("tiered", "must be true, false or None (auto)")
        if self.scheduler not in SCHEDULERS:
            bad("scheduler", f"must be one of {', '.join(SCHEDULERS)}")
        if isinstance(self.resident_layers, bool) or not isinstance(self.resident_layers, int) or self.resident_layers < 0:
            bad("resident_layers", "must be an integer >= 0")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (validated again); an unknown name is a TypeError naming it."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown engine setting(s) {sorted(unknown)}; known: {[f.name for f in fields(self)]}")
        return dataclasses.replace(self, **changes)

    @property
    def device_budget(self) -> int | None:
        """The device tier's budget in bytes (None: unlimited)."""
        return None if self.device_budget_gb is None else int(self.device_budget_gb * (1 << 30))

    def is_tiered(self, device_type: str) -> bool:
        """Whether the full KV lives in a host tier behind a link, on a device of ``device_type``."""
        return device_type != "cpu" if self.tiered is None else self.tiered

    def load_model(self) -> LoadedModel:
        """The model this config names, loaded where and as it says (device, dtypes, kernels, numerics): the
        one place a config becomes a ``LoadedModel`` (the engine, the server, the verifier, ``vericache
        prefix``), so none of them drops a field."""
        from vericache.model.loader import load_model

        return load_model(self.model, device=self.device, dtype=self.dtype, kv_dtype=self.kv_dtype,
                          kernels=self.kernels, numerics=self.numerics)

    # ------------------------------------------------------------------ the other two ways in
    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> EngineConfig:
        """From Triton's config.pbtxt parameters (strings; "" or absent: the default). Names are the
        fields'; ``device_budget_gb`` "none" means no limit; ``draft_len`` 0 means "auto"."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(k for k, v in params.items() if v not in ("", None)) - set(known) - IGNORED_PARAMETERS
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {sorted(unknown)}; known: {sorted(known)}")
        values = {}
        for name, text in params.items():
            if name in known and text not in ("", None):
                values[name] = _parse_field(name, str(text))
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, only: tuple[str, ...] | None = None) -> EngineConfig:
        """From the flags ``add_engine_args`` added (``--device-budget-gb 0``: no limit); ``only``: just these
        fields (a command whose other flags mean something else, e.g. ``MODEL_FIELDS``), the rest defaults."""
        names = only or [f.name for f in fields(cls)]
        values = {name: getattr(args, name) for name in names if hasattr(args, name)}
        if values.get("device_budget_gb") == 0:
            values["device_budget_gb"] = None
        return cls(**values)


IGNORED_PARAMETERS = {"EXECUTION_ENV_PATH"}   # Triton's own parameters, beside ours in config.pbtxt


def _parse_field(name: str, text: str) -> Any:
    """One config.pbtxt string as the field's type."""
    if name == "draft_len":
        return "auto" if text in ("auto", "0") else int(text)
    if name == "draft_vocab":
        return text if text == "auto" else int(text)
    if name == "lookup":
        return {"true": True, "false": False}[text.lower()]
    if name == "tiered":
        return {"true": True, "false": False, "auto": None}[text.lower()]
    if name == "device_budget_gb":
        return None if text.lower() == "none" else float(text)
    if name in ("prefill_chunk", "max_running", "max_queue", "resident_layers"):
        return int(text)
    return text


DEFAULTS = EngineConfig()
# the plainest engine: exact full decoding, drafts on the exact weights, no lookup proposals, no device
# budget, the full KV where the model runs (a bare ``ModelRunner``/``StepLoop``, as unit tests build them)
EXACT_FULL = EngineConfig(mode="full", draft_weights="fp32", lookup=False, device_budget_gb=None, tiered=False)


ARG_GROUPS = ("model", "mode", "loop")
MODEL_FIELDS = ("model", "device", "dtype", "kv_dtype", "kernels", "numerics")   # the "model" group's
MODE_FIELDS = ("mode", "compressor", "draft_len", "draft_weights", "draft_vocab", "lookup", "acceptance")   # "mode"'s


def add_engine_args(p: argparse.ArgumentParser, groups: tuple[str, ...] = ARG_GROUPS) -> None:
    """The engine's flags, each default the config's: "model" (--model --device --dtype --kv-dtype
    --kernels --numerics), "mode" (--mode --compressor --draft-len --draft-weights --draft-vocab --lookup
    --acceptance), "loop" (--prefill-chunk
    --max-queue --device-budget-gb --tiered --scheduler). ``EngineConfig.from_args`` reads them back."""
    d = DEFAULTS
    if "model" in groups:
        p.add_argument("--model", default=d.model, help="model name (see `vericache models`), Hugging Face "
                                                        f"directory or .gguf file (default: {d.model})")
        p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
        p.add_argument("--dtype", default=d.dtype, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
        add_kv_dtype_arg(p)
        p.add_argument("--kernels", default=d.kernels, choices=["native", "triton", "torch"],
                       help="what the forward runs on (default: native on the CPU, Triton on a GPU)")
        add_numerics_arg(p)
    if "mode" in groups:
        p.add_argument("--mode", default=d.mode, choices=MODES, help=f"what a request gets when it does not ask "
                                                                     f"(default: {d.mode})")
        p.add_argument("--compressor", default=d.compressor,
                       help=f"e.g. snapkv:ratio=0.25 or h2o:ratio=0.125+kivi:bits=4 (default: {d.compressor})")
        p.add_argument("--draft-len", default=d.draft_len, type=draft_len_arg, help="tokens per draft round, or auto")
        p.add_argument("--draft-weights", default=d.draft_weights, choices=DRAFT_WEIGHTS,
                       help="weights the drafts read (CPU): fp32 (exact), q8 (int8 activations x the stored blocks), "
                            "int8, int4, or auto (per step, fp32 or q8, whichever measured faster here for its draft "
                            "rows; fp32 off CPU); verification is exact either way")
        p.add_argument("--draft-vocab", default=d.draft_vocab, type=draft_vocab_arg,
                       help="tokens a draft takes logits for: the first n token ids (a BPE vocabulary's "
                            "most frequent), 0 for all, or auto (32768 where the vocabulary is over twice that); "
                            "verification's head decides every token either way")
        p.add_argument("--lookup", default=d.lookup, action=argparse.BooleanOptionalAction,
                       help="prompt-lookup proposals: where the last tokens occurred earlier, the drafter checks "
                            "what followed them in one step (a request's own option overrides it)")
        p.add_argument("--acceptance", default=d.acceptance, choices=ACCEPTANCE_RULES,
                       help="how sampled drafts are accepted: coupled (drafter and verifier share the Gumbel "
                            "noise of (seed, position): a seeded text is seeded full decoding's) or rejection "
                            "(min(1, p/q): exact in distribution only)")
    if "loop" in groups:
        p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                       help="prompt tokens a request prefills per engine step (smaller: other requests wait less)")
        p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests accepted before 429")
        p.add_argument("--device-budget-gb", type=float, default=d.device_budget_gb,
                       help="KV the device tier may hold, GiB (0: no limit)")
        p.add_argument("--tiered", default=d.tiered, action=argparse.BooleanOptionalAction,
                       help="full KV in a host tier, brought over a link per verification (default: only on CUDA)")
        p.add_argument("--scheduler", default=d.scheduler, choices=SCHEDULERS, help="the link schedule when tiered")


def add_numerics_arg(p: argparse.ArgumentParser) -> None:
    """--numerics: the CPU forward's arithmetic (``loader.parse_numerics``)."""
    p.add_argument("--numerics", default=DEFAULTS.numerics, choices=NUMERICS,
                   help="the CPU forward's numerics, full mode, verification and drafts alike: q8 (int8 "
                        "activations x the stored integer codes, exact integer sums), q8qk (q8, and attention "
                        "in integer dots too: faster at long contexts) or fp32 (exact dequantization); default: "
                        "$VERICACHE_NUMERICS, else q8qk for a GGUF model with integer blocks, else fp32")


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-dtype: what the full KV caches hold (attention computes in fp32 on the CPU either way)."""
    p.add_argument("--kv-dtype", default=DEFAULTS.kv_dtype, choices=KV_DTYPES,
                   help="the full KV cache's dtype (default: float16 on the CPU, as llama.cpp; the weights' on CUDA)")


def int_or_auto(flag: str) -> Callable[[str], int | str]:
    """An argparse type for ``flag``: an integer, or "auto"."""
    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer or 'auto', got {text!r}") from None
    return parse


draft_len_arg = int_or_auto("--draft-len")      # an integer, or "auto"
draft_vocab_arg = int_or_auto("--draft-vocab")  # a token count (0: all), or "auto"
