"""The files of a Hugging Face checkpoint directory, and what its weights hold in memory once loaded."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from vericache.config import ModelConfigError
from vericache.model.gguf_file import REST_FILE, STORED_FILE


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of dense weights (a converted GGUF model's: those not kept as blocks)."""
    for single in (model_dir / "model.safetensors", model_dir / REST_FILE):   # a conversion before rest.safetensors
        if single.exists():                                                 # wrote a whole fp32 model.safetensors
            return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelConfigError(f"corrupt weight index {index}: {exc}") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    raise ModelConfigError(f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json")


def weight_bytes(model_dir: Path) -> int:
    """Bytes of weights ``load_model`` holds on the CPU in fp32 (a GGUF model's matrices as stored
    blocks), read from the files' headers without loading them."""
    files = [model_dir / STORED_FILE] if (model_dir / STORED_FILE).exists() else []
    total, seen = 0, set()
    for f in files + weight_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key in seen:
                    continue
                seen.add(key)
                sl = fh.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * (1 if sl.get_dtype() in ("U8", "I8") else 4)   # stored bytes, else fp32
    return total
