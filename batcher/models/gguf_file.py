"""A GGUF file's header: its metadata values and where each tensor's bytes lie, read without
building the large metadata arrays (a tokenizer's vocabulary and merges) that loading weights does
not need. The gguf package's reader makes a numpy object per array element, which for a 49k-token
vocabulary costs seconds and ~160 MiB at load; here a string array is stepped over and a numeric
one is a view.

Layout (little-endian): magic "GGUF", version u32 (2 or 3), tensor count u64, metadata count u64;
each metadata entry a string key, a value type u32 and the value (a string is a u64 length and
bytes, an array an item type u32, a u64 count and the items); each tensor a string name, a u32
dimension count, u64 dimensions (fastest first), a u32 type and a u64 offset; the tensors' data
starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> numpy dtype of the fixed-size types
_FIXED = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
          4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
          10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8")}


@dataclass(slots=True, frozen=True)
class StringArray:
    """A metadata array of strings, stepped over: only its length is kept."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(slots=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # as the gguf package shapes it: quantized -> uint8 [..., bytes per row]


class GGUFFile:
    """`fields`: metadata key -> int, float, bool, str, a numpy array or a `StringArray`;
    `tensors`: in file order, their data views into the file's read-only mapping."""

    def __init__(self, path: str | Path):
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._take(4)) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = self._u(4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_fields = self._u(8), self._u(8)
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._u(8) for _ in range(self._u(4))]
            infos.append((name, dims, self._u(4), self._u(8)))
        align = int(self.fields.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-self._pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            if dims[0] % block:
                raise ValueError(f"tensor {name}: row of {dims[0]} not a multiple of {block}")
            row_bytes = dims[0] // block * size
            rows = int(np.prod(dims[1:], dtype=np.int64))
            lo = start + offset
            raw = self._mm[lo:lo + rows * row_bytes]
            if raw.size != rows * row_bytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            shape = tuple(reversed(dims))  # numpy order, rows first
            code = _plain_code(kind)
            if code is not None:  # a plain float or integer type: typed elements
                data = raw.view(np.dtype(f"<{code}")).reshape(shape)
            else:  # blocks (or bfloat16, which numpy lacks): bytes per row
                data = raw.reshape(*shape[:-1], row_bytes)
            self.tensors.append(TensorInfo(name, GGMLQuantizationType(kind), data))

    def _take(self, n: int) -> np.ndarray:
        if self._pos + n > self._mm.size:
            raise ValueError("GGUF header runs past the end of the file")
        out = self._mm[self._pos:self._pos + n]
        self._pos += n
        return out

    def _u(self, size: int) -> int:
        return int.from_bytes(self._take(size).tobytes(), "little")

    def _string(self) -> str:
        return self._take(self._u(8)).tobytes().decode("utf-8", errors="replace")

    def _value(self, kind: int) -> object:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u(4), self._u(8)
            if item == _STRING:
                for _ in range(count):  # step over: a u64 length, then the bytes
                    self._pos += 8 + struct.unpack_from("<Q", self._mm, self._pos)[0]
                if self._pos > self._mm.size:
                    raise ValueError("GGUF header runs past the end of the file")
                return StringArray(count)
            if item not in _FIXED:
                raise ValueError(f"unsupported GGUF array item type {item}")
            dt = _FIXED[item]
            return self._take(count * dt.itemsize).view(dt)
        if kind not in _FIXED:
            raise ValueError(f"unsupported GGUF value type {kind}")
        dt = _FIXED[kind]
        return self._take(dt.itemsize).view(dt)[0].item()


def _plain_code(kind: int) -> str | None:
    T = GGMLQuantizationType
    codes = {T.F32: "f4", T.F16: "f2", T.F64: "f8", T.I8: "i1", T.I16: "i2", T.I32: "i4",
             T.I64: "i8"}
    return codes.get(T(kind))
