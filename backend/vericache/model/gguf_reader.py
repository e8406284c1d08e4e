"""A GGUF file's header and tensors, read in one pass.

The ``gguf`` package's ``GGUFReader`` makes a numpy view for every item of every metadata array: a
vocabulary of 49K-152K tokens and as many merges cost it 9 s (SmolLM2) to 30 s (Qwen2.5), most of a
first load. Here the header is parsed with ``struct`` from one buffer (well under a second) and each
tensor's data is a view into one read-only ``np.memmap``, shaped as ``GGUFReader`` shapes it, so
``gguf.quants.dequantize`` reads it unchanged. The format (little-endian, versions 2 and 3):

    magic "GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata:    string key | u32 value type | value   (an array: u32 item type | u64 count | items)
    tensor info: string name | u32 dims | u64 dims[n] (fastest first) | u32 ggml type | u64 offset
    padding to ``general.alignment`` (32), then the tensors' data at their offsets
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of one scalar (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# ggml types whose data are plain numbers (everything else is blocks, read as uint8)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]      # ggml order: the fastest dimension first (a matrix [n, k] is (k, n))
    tensor_type: object         # gguf.GGMLQuantizationType
    data: np.ndarray            # numbers [reversed shape], or blocks uint8 [rows, row bytes]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class GGUFContents:
    meta: dict            # every metadata key -> a Python value (str, int, float, bool or a list of them)
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from ``buf`` at a moving offset; a read past the end is a ValueError."""

    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ValueError(f"the header ends early (offset {self.at})")
        value = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end (offset {self.at})")
        s = bytes(self.buf[self.at:self.at + n]).decode("utf-8")
        self.at += n
        return s

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:   # numbers in one read
                dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
                end = self.at + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError(f"an array of {count} items runs past the end (offset {self.at})")
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.at).tolist()
                self.at = end
                return out
            return [self.value(item) for _ in range(count)]   # arrays of arrays
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind} (offset {self.at})")
        return self.unpack(_SCALARS[kind])


def read_gguf(path: str | Path) -> GGUFContents:
    """The metadata and tensors of the GGUF file at ``path``; ValueError for a file that is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    cur = _Cursor(data.data)   # a memoryview's slices are cheap; a memmap's each make a new array
    if bytes(data[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file (no GGUF magic)")
    cur.at = 4
    version = cur.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} (big-endian or unknown); supported: {SUPPORTED_VERSIONS}")
    n_tensors, n_meta = cur.unpack("<Q"), cur.unpack("<Q")
    meta = {}
    for _ in range(n_meta):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = -(-cur.at // align) * align
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        kind = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[kind]
        n = int(np.prod(dims))
        first, size = start + offset, n * type_size // block
        if first + size > len(data):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        if kind.name in _PLAIN:
            view = data[first:first + size].view(_PLAIN[kind.name]).reshape(shape)
        else:
            view = data[first:first + size].reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, dims, kind, view))
    return GGUFContents(meta, tensors)
