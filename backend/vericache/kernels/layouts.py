"""The numbers the Python side hands the native kernels, by name: the store kinds of K/V rows, a cache
part's arguments to the packed op, and the GGUF weight formats. The C++ side defines each once too
(``layouts.h``: store kinds and a part's layout; ``gguf_blocks.h``: the formats and their block sizes);
``check_headers`` holds the two sides together before any build of the kernels (``kernels.load_extension``,
``linear_op.compile_linear``, the wheel's ``setup.py``) and in the tests, so a number changed on one
side alone fails there, naming the difference, instead of sending tensors to the wrong slots.

Standard library only: ``setup.py`` loads this file on its own.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).parent

# The kinds of stored key/value rows the attention kernels read (``kv.quantized``'s layouts, ``kv.packed``'s
# op arguments, the Triton twin; ``layouts.h``'s StoreKind)
TOKEN_GROUPS = 0     # per token, min/max over groups of channels (INT4/INT8; KIVI's values)
CHANNEL_GROUPS = 1   # per channel, min/max over groups of positions (KIVI's keys)
FP8 = 2              # e4m3 codes, one fp16 scale per token row
DENSE = 3            # dense rows (fp32, fp16, bf16): a full cache, a compressed cache's residual
STORE_KINDS = {"TOKEN_GROUPS": TOKEN_GROUPS, "CHANNEL_GROUPS": CHANNEL_GROUPS, "FP8": FP8, "DENSE": DENSE}

# A cache part's arguments to the packed op, in order (``kv.packed.op_args``; ``layouts.h``'s PartInt and
# PartTensor): its sequence, keys per KV head and causal diagonal, then K's and V's store kind, bits a
# code and group size, and whether its scores are exact (the model's numerics; 0: a drafter's part, fp32
# scores); K's rows (or codes), scale and zero, V's alike, KIVI's group positions and the
# optional attention-seen output; a dense part's q8qk codes of its keys and values, and how many keys hold
# them (``kv.packed.KeyCodes``).
PART_INTS = ("seq", "n_keys", "diag", "k_kind", "k_bits", "k_group", "v_kind", "v_bits", "v_group", "exact")
PART_TENSORS = ("k_rows", "k_scale", "k_zero", "v_rows", "v_scale", "v_zero", "pos", "seen", "k_codes", "k_dk",
                "k_csum", "v_codes", "v_dv", "k_coded")

# GGUF (ggml) type names -> the linear op's format codes (``gguf_blocks.h``'s Fmt); bytes and elements a block
FORMATS = {"F32": 0, "F16": 1, "BF16": 2, "Q4_0": 3, "Q4_1": 4, "Q5_0": 5, "Q5_1": 6, "Q8_0": 7,
           "Q4_K": 8, "Q5_K": 9, "Q6_K": 10}
BLOCK = {"F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32),
         "Q5_1": (24, 32), "Q8_0": (34, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def header_enum(text: str, name: str) -> dict[str, int]:
    """``enum <name> { A = 0, B = 1, ... }`` in C++ ``text`` as {"A": 0, "B": 1, ...}. Every value must be
    written out: ValueError naming the enum when it is missing or a value is implicit."""
    found = re.search(r"enum\s+" + re.escape(name) + r"\s*\{([^}]*)\}", text)
    if found is None:
        raise ValueError(f"no enum {name} in the header")
    values = {}
    for item in (x.strip() for x in re.sub(r"//[^\n]*", "", found.group(1)).split(",")):
        if item:
            m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", item)
            if m is None:
                raise ValueError(f"enum {name}: {item!r} has no explicit value")
            values[m.group(1)] = int(m.group(2))
    return values


def header_table(text: str, name: str) -> list[int]:
    """``static const int <name>[] = {...};`` in C++ ``text`` as a list (ValueError when it is missing)."""
    found = re.search(r"static const int\s+" + re.escape(name) + r"\[\]\s*=\s*\{([^}]*)\}", text)
    if found is None:
        raise ValueError(f"no table {name}[] in the header")
    return [int(x) for x in found.group(1).split(",") if x.strip()]


def _in_order(names: tuple[str, ...], count: str) -> dict[str, int]:
    return {**{n.upper(): i for i, n in enumerate(names)}, count: len(names)}


def differences(headers: Path = HERE) -> list[str]:
    """Where the C++ headers in ``headers`` and this module disagree (empty: they agree)."""
    layouts, gguf = (headers / "layouts.h").read_text(), (headers / "gguf_blocks.h").read_text()
    by_code = sorted(FORMATS, key=FORMATS.__getitem__)
    pairs = [("store kinds (layouts.h StoreKind)", header_enum(layouts, "StoreKind"), STORE_KINDS),
             ("part ints (layouts.h PartInt)", header_enum(layouts, "PartInt"), _in_order(PART_INTS, "PART_INTS")),
             ("part tensors (layouts.h PartTensor)", header_enum(layouts, "PartTensor"),
              _in_order(PART_TENSORS, "PART_TENSORS")),
             ("GGUF formats (gguf_blocks.h Fmt)", header_enum(gguf, "Fmt"), FORMATS),
             ("GGUF block bytes (gguf_blocks.h block_bytes)", dict(zip(by_code, header_table(gguf, "BLOCK_BYTES"))),
              {f: BLOCK[f][0] for f in by_code})]
    return [f"{what}: the header has {cpp}, the Python side {py}" for what, cpp, py in pairs if cpp != py]


def check_headers(headers: Path = HERE) -> None:
    """RuntimeError listing every disagreement between the kernels' headers and this module."""
    found = differences(headers)
    if found:
        raise RuntimeError("the kernels' headers and vericache/kernels/layouts.py disagree:\n  " + "\n  ".join(found))
