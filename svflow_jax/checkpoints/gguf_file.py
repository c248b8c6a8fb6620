"""The header of a GGUF file (metadata and tensor table), read from one read-only memory map.

Layout read here (GGUF versions 2 and 3; every number little-endian):

* ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 key-value count;
* each key-value pair: the key as a string (uint64 byte length, then UTF-8 bytes), a uint32
  value type, the value. Value types: 0 UINT8, 1 INT8, 2 UINT16, 3 INT16, 4 UINT32, 5 INT32,
  6 FLOAT32, 7 BOOL (one byte), 8 STRING, 9 ARRAY (uint32 element type, uint64 count, the
  elements), 10 UINT64, 11 INT64, 12 FLOAT64;
* each tensor: its name as a string, uint32 n_dims, n_dims uint64 dimensions (innermost
  first), uint32 ggml type, uint64 offset;
* the tensor data, from the first multiple of ``general.alignment`` (a UINT32, a power of
  two; 32 when absent) after the tensor table; each tensor at that start plus its offset.

The metadata is what the ``gguf`` package's ``GGUFReader`` gives as
``{name: field.contents()}``: Python ``int``/``float``/``bool``/``str`` and lists of them,
after three entries of the header itself (``GGUF.version``, ``GGUF.tensor_count``,
``GGUF.kv_count``). Each tensor's data is the memory map's view ``GGUFReader`` gives: a typed
array of the tensor's shape for F32/F16/F64/I8-I64, otherwise the uint8 bytes shaped by
``gguf.quants.quant_shape_to_byte_shape`` (what ``gguf.quants.dequantize`` takes). The ggml
type tables are the ``gguf`` package's.

Refused, as a :class:`~.base.CheckpointError` naming the file: another magic or version,
big-endian files, arrays of arrays (llama.cpp refuses them too), unknown value or tensor
types, invalid UTF-8, duplicate keys or tensor names, any count, length or tensor that reaches
past the end of the file (checked before anything is looped over or allocated).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from svflow_jax.checkpoints.base import CheckpointError

if TYPE_CHECKING:  # imported where a tensor is read: the gguf package takes 0.1 s to import
    import gguf

__all__ = ["GGUFTensor", "read_gguf"]

_STRING, _ARRAY = 8, 9
# Fixed-size value types: NumPy dtype (little-endian) of each.
_DTYPES = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
# Smallest encodings: a key-value pair (empty key, type, one byte) and a tensor (empty name,
# n_dims, type, offset).
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8
# Tensor types read as typed arrays (as GGUFReader does); every other type as bytes.
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    ``shape`` is in NumPy order (the file's dimensions reversed), ``data_offset`` the
    tensor's first byte in the file, ``data`` a read-only view of the memory map (typed, or
    bytes for quantised and BF16 tensors)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    data: np.ndarray


class _Bad(Exception):
    """A damaged or unsupported header; :func:`read_gguf` names the file."""


class _Cursor:
    """Reads the header front to back, checking every length against the bytes left."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> int:
        """Reserves ``n`` bytes; returns where they start."""
        start = self.pos
        if n > len(self.buf) - start:
            raise _Bad(f"{what} at byte {start} needs {n} bytes, the file has "
                       f"{len(self.buf) - start} left")
        self.pos = start + n
        return start

    def uint(self, fmt: struct.Struct, what: str) -> int:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def count(self, n: int, size: int, what: str) -> int:
        """A count of items of at least ``size`` bytes each that must fit in the file."""
        if n * size > len(self.buf) - self.pos:
            raise _Bad(f"{what} at byte {self.pos}: {n} items cannot fit in the "
                       f"{len(self.buf) - self.pos} bytes left")
        return n

    def string(self, what: str) -> str:
        n = self.uint(_U64, what)
        start = self.take(n, what)
        return str(self.buf[start:start + n], "utf-8")

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings: the tight loop of token and merge lists."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        for _ in range(self.count(n, 8, what)):
            if end - pos < 8:
                raise _Bad(f"{what}: the file ends inside the array")
            (size,) = unpack(buf, pos)
            pos += 8
            if size > end - pos:
                raise _Bad(f"{what}: a string at byte {pos} of {size} bytes passes the end")
            out.append(str(buf[pos:pos + size], "utf-8"))
            pos += size
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.uint(_U32, what)
            n = self.uint(_U64, what)
            if etype == _STRING:
                return self.strings(n, what)
            dtype = self._dtype(etype, what)
            start = self.take(self.count(n, dtype.itemsize, what) * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, n, start).tolist()
        dtype = self._dtype(vtype, what)
        return np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize, what)).tolist()[0]

    @staticmethod
    def _dtype(vtype: int, what: str) -> np.dtype:
        if vtype == _ARRAY:
            raise _Bad(f"{what}: arrays of arrays are not supported")
        if vtype not in _DTYPES:
            raise _Bad(f"{what}: unknown value type {vtype}")
        return _DTYPES[vtype]


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The metadata and the tensors (by name, in file order) of a GGUF file.

    Raises:
        CheckpointError: the file is damaged or not a GGUF file this reader supports.
    """
    try:
        if Path(path).is_file() and Path(path).stat().st_size == 0:
            raise _Bad("the file is empty")
        return _read(np.memmap(path, np.uint8, mode="r"))
    except (_Bad, OSError, ValueError, struct.error) as err:
        # ValueError: invalid UTF-8, an unknown ggml type, a quantised row not a whole number
        # of blocks.
        raise CheckpointError(f"{path}: unreadable GGUF header or tensor table (damaged, or "
                              f"not a GGUF file this reader supports): {_in_words(err)}"
                              ) from None


def _in_words(err: Exception) -> str:
    """What went wrong reading a GGUF file, in words (no exception class names)."""
    if isinstance(err, _Bad):
        return str(err)
    if isinstance(err, UnicodeDecodeError):
        return f"a string is not UTF-8 (byte {err.start}: {err.reason})"
    if isinstance(err, OSError):
        return f"cannot read it ({err.strerror or err})"
    if isinstance(err, struct.error):
        return "the file ends inside the header"
    return str(err)


def _read(mm: np.memmap) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    at = _Cursor(mm.data)
    magic, version, n_tensors, n_kv = _HEADER.unpack_from(at.buf, at.take(_HEADER.size, "header"))
    if magic != b"GGUF":
        raise _Bad(f"not a GGUF file (magic {magic!r})")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and swapped in (2, 3):
            raise _Bad("a big-endian GGUF file (not supported)")
        raise _Bad(f"GGUF version {version} (supported: 2, 3)")
    if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR > len(at.buf) - at.pos:
        raise _Bad(f"{n_kv} key-value pairs and {n_tensors} tensors cannot fit in the file")
    meta: dict[str, Any] = {
        "GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv
    }
    alignment = 32
    for _ in range(n_kv):
        key = at.string("a metadata key")
        if key in meta:
            raise _Bad(f"duplicate metadata key {key!r}")
        vtype = at.uint(_U32, key)
        meta[key] = at.value(vtype, key)
        if key == "general.alignment":
            alignment = meta[key]
            if vtype != 4 or alignment <= 0 or alignment & (alignment - 1):
                raise _Bad(f"general.alignment must be a UINT32 power of two, not {alignment!r}")
    table = []
    for _ in range(n_tensors):
        name = at.string("a tensor name")
        n_dims = at.count(at.uint(_U32, name), 8, name)
        dims = struct.unpack_from(f"<{n_dims}Q", at.buf, at.take(8 * n_dims, name))
        table.append((name, dims, at.uint(_U32, name), at.uint(_U64, name)))
    start = -(-at.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in table:
        if name in tensors:
            raise _Bad(f"duplicate tensor name {name!r}")
        tensors[name] = _tensor(mm, name, dims, raw_type, start + offset)
    return meta, tensors


def _tensor(
    mm: np.memmap, name: str, dims: tuple[int, ...], raw_type: int, offset: int
) -> GGUFTensor:
    """A tensor's entry of the table, its data checked to lie inside the file."""
    import gguf

    qtype = gguf.GGMLQuantizationType(raw_type)  # ValueError for an unknown type
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise _Bad(f"tensor {name!r}: no block size known for type {qtype.name}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(dims))
    n_bytes = math.prod(dims) * type_size // block
    if offset + n_bytes > len(mm):
        raise _Bad(f"tensor {name!r} ({qtype.name}, shape {shape}) at byte {offset}, "
                   f"{n_bytes} bytes, passes the end of the file ({len(mm)} bytes)")
    raw = mm[offset:offset + n_bytes]
    if qtype.name in _TYPED:
        data = raw.view(_TYPED[qtype.name]).reshape(shape)
    elif not shape:
        raise _Bad(f"tensor {name!r}: a {qtype.name} tensor without dimensions")
    else:
        data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
    return GGUFTensor(name, shape, qtype, offset, n_bytes, data)
