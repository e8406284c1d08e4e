"""Compressor spec strings: ``name``, ``name:key=value,...`` and ``eviction+quantization``."""

from __future__ import annotations

import dataclasses

from vericache.compress.base import Composed, Compressor, EvictionCompressor, QuantCompressor
from vericache.compress.eviction import H2O, KVzip, SnapKV, StreamingLLM
from vericache.compress.quant import FP8, KIVI, Int4, Int8

METHODS: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (StreamingLLM, SnapKV, H2O, KVzip, KIVI, Int4, Int8, FP8)
}


def _parameters(cls: type[Compressor]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _coerce(cls: type[Compressor], key: str, raw: str):
    default = _parameters(cls)[key].default
    try:
        if isinstance(default, bool):
            flag = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(raw.lower())
            if flag is None:
                raise ValueError
            return flag
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"{cls.name}: {key}={raw!r} is not a valid {type(default).__name__}"
                         + (" (true or false)" if isinstance(default, bool) else "")) from None
    return raw


def parse_one(spec: str) -> Compressor:
    name, _, params = spec.strip().partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(METHODS)}")
    cls = METHODS[name]
    kwargs = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"{name}: expected key=value, got {item!r}")
        if key not in _parameters(cls):
            raise ValueError(f"{name}: unknown parameter {key!r}; parameters: {', '.join(_parameters(cls))}")
        kwargs[key] = _coerce(cls, key, raw)
    return cls(**kwargs)


def parse_compressor(spec: str | Compressor) -> Compressor:
    """``snapkv:ratio=0.25`` -> SnapKV(ratio=0.25); ``snapkv:ratio=0.25+kivi:bits=4`` -> Composed."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec must be a non-empty string, got {spec!r}")
    parts = [parse_one(p) for p in spec.split("+")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2 and isinstance(parts[0], EvictionCompressor) and isinstance(parts[1], QuantCompressor):
        return Composed(evictor=parts[0], quantizer=parts[1])
    raise ValueError(f"a composition is 'eviction+quantization' (e.g. snapkv:ratio=0.25+kivi:bits=4), got {spec!r}")


def describe_methods() -> list[dict]:
    """Every method with its kind, parameters and defaults (``vericache compressors``)."""
    rows = []
    for name, cls in METHODS.items():
        params = {k: f.default for k, f in _parameters(cls).items()}
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        rows.append({"name": name, "kind": cls.kind, "parameters": params, "summary": doc})
    return rows
