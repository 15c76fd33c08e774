"""A GGUF (v2/v3) reader: metadata, tensor table, raw blocks and dequantized torch tensors.

File layout (little-endian; ggml/docs/gguf.md)::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset

Strings are ``u64 length + utf-8 bytes``. Dims are ggml order (fastest first); this module reports
torch order (reversed), so a ggml ``[576, 49152]`` embedding is a torch ``[49152, 576]`` tensor.
The file is memory-mapped; nothing is unpickled, and tensor bytes are read only when asked for.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_quants import BLOCK_LAYOUT, DEQUANTIZABLE, PLAIN_TYPES, GGMLType, dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of arrays nest by recursion; real files nest at most once, so a deeper file is corrupt (and
# would otherwise end in a RecursionError).
_MAX_ARRAY_NESTING = 8

# Metadata value types (gguf_type in gguf.h): id -> struct format of a scalar.
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_SCALAR_DTYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table. ``shape`` is in torch order; ``offset`` is absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(
                f"truncated or corrupt GGUF file {self.path}: header needs {n} bytes at offset "
                f"{self.pos}, file has {len(self.buf)}"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"corrupt GGUF file {self.path}: invalid utf-8 string ({e})") from None

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary's tokens and merges, 100k+ of them): :meth:`string`'s reads and
        checks in one loop over local names."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > end:
                    break
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    pos -= 8
                    break
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise ValueError(f"corrupt GGUF file {self.path}: invalid utf-8 string ({e})") from None
        self.pos = pos
        if len(out) < count:  # truncated: the remaining string's read raises the usual error
            self.string()
        return out

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            elem_type, count = self.scalar("<I"), self.scalar("<Q")
            if depth >= _MAX_ARRAY_NESTING:
                raise ValueError(f"corrupt GGUF file {self.path}: arrays nested over {_MAX_ARRAY_NESTING} deep")
            if elem_type in _SCALAR_DTYPES:
                # Numeric arrays (token types, scores) can hold 100k+ entries: read them in one go.
                dtype = np.dtype(_SCALAR_DTYPES[elem_type]).newbyteorder("<")
                self._need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            if elem_type == _STRING:
                return self._strings(count)
            return [self.value(elem_type, depth + 1) for _ in range(count)]
        raise ValueError(f"corrupt GGUF file {self.path}: unknown metadata value type {value_type}")


class GGUFFile:
    """A memory-mapped GGUF file.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: ``{key: value}``; arrays are Python lists (strings, numbers, nested lists).
        tensors: ``{name: GGUFTensorInfo}`` in file order.
        alignment: data alignment in bytes (``general.alignment``, default 32).
        data_start: absolute offset of the tensor data section.

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` naming the file for a bad
    magic, unsupported version, truncated header or data, or an unknown tensor type.
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        size = self.path.stat().st_size
        if size < 24:
            raise ValueError(f"not a GGUF file (only {size} bytes): {self.path}")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._mm), self.path)  # type: ignore[arg-type]

        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise ValueError(f"bad magic {bytes(self._mm[:4])!r} (expected b'GGUF'): {self.path}")
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            if self.version in (2 << 24, 3 << 24):
                raise ValueError(f"big-endian GGUF files are not supported: {self.path}")
            raise ValueError(f"unsupported GGUF version {self.version} (expected 2 or 3): {self.path}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(self.alignment, int)
            or isinstance(self.alignment, bool)
            or self.alignment <= 0
            or self.alignment & (self.alignment - 1)
        ):
            raise ValueError(f"general.alignment must be a power of two, got {self.alignment!r}: {self.path}")

        table = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > _MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dims (max {_MAX_DIMS}): {self.path}")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            type_id, offset = cur.scalar("<I"), cur.scalar("<Q")
            table.append((name, dims, type_id, offset))
        self.data_start = -(-cur.pos // self.alignment) * self.alignment

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in table:
            self.tensors[name] = self._check_tensor(name, dims, type_id, offset, size)

    def _check_tensor(
        self, name: str, dims: list[int], type_id: int, offset: int, size: int
    ) -> GGUFTensorInfo:
        if name in self.tensors:
            raise ValueError(f"duplicate tensor name {name!r}: {self.path}")
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {type_id}: {self.path}") from None
        block_elems, block_bytes = BLOCK_LAYOUT[ggml_type]
        row = dims[0] if dims else 1
        if row % block_elems:
            raise ValueError(
                f"tensor {name!r}: row length {row} is not a multiple of the {ggml_type.name} block "
                f"size {block_elems}: {self.path}"
            )
        if offset % self.alignment:
            raise ValueError(f"tensor {name!r}: offset {offset} is not {self.alignment}-aligned: {self.path}")
        # Python ints: garbage dims must not wrap around in int64 and slip past the size check.
        numel = math.prod(dims)
        nbytes = numel // block_elems * block_bytes
        start = self.data_start + offset
        if start + nbytes > size:
            raise ValueError(
                f"truncated GGUF file {self.path}: tensor {name!r} spans bytes [{start}, {start + nbytes}) "
                f"but the file has {size}"
            )
        return GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    # --- metadata helpers -------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"GGUF file has no general.architecture: {self.path}")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None

    # --- tensor data --------------------------------------------------------------------------

    def raw(self, name: str) -> tuple[np.ndarray, GGMLType, tuple[int, ...]]:
        """The stored bytes of a tensor, without a copy.

        Returns:
            ``(blocks, ggml_type, shape)``: ``blocks`` is a read-only ``uint8`` view
            ``[*shape[:-1], shape[-1] // block_elems, block_bytes]`` (for plain types such as F32,
            ``block_elems == 1`` and ``block_bytes`` is the item size); blocks run along the last
            (contiguous) torch dim. ``shape`` is the logical torch-order shape.
        """
        info = self._info(name)
        block_elems, block_bytes = BLOCK_LAYOUT[info.ggml_type]
        shape = info.shape or (1,)
        flat = self._mm[info.offset : info.offset + info.nbytes]
        blocks = np.ndarray((*shape[:-1], shape[-1] // block_elems, block_bytes), dtype=np.uint8, buffer=flat)
        blocks.flags.writeable = False
        return blocks, info.ggml_type, info.shape

    def tensor(self, name: str, *, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """A tensor dequantized (or read) into a fresh torch tensor of torch-order shape.

        Float and block types dequantize in fp32 then cast to ``dtype`` (F16/BF16 are cast
        directly, which is exact). Integer/F64 types keep their dtype when ``dtype`` is None.
        """
        info = self._info(name)
        blocks, ggml_type, shape = self.raw(name)
        if ggml_type is GGMLType.F16 or ggml_type is GGMLType.BF16:
            bits = torch.from_numpy(np.array(blocks).view(np.int16)).reshape(shape)
            t = bits.view(torch.float16 if ggml_type is GGMLType.F16 else torch.bfloat16)
        elif ggml_type in PLAIN_TYPES:
            t = torch.from_numpy(np.array(blocks).view(PLAIN_TYPES[ggml_type]).reshape(shape))
        elif ggml_type in DEQUANTIZABLE:
            t = torch.from_numpy(dequantize(blocks, ggml_type)).reshape(shape)
        else:
            raise ValueError(
                f"tensor {info.name!r} has type {ggml_type.name}, which has no dequantizer "
                f"(supported: {sorted(t.name for t in DEQUANTIZABLE)}): {self.path}"
            )
        return t if dtype is None else t.to(dtype)

    def iter_tensors(
        self, *, dtype: torch.dtype | None = torch.float32
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(gguf_name, tensor)`` for every tensor, in file order."""
        for name in self.tensors:
            yield name, self.tensor(name, dtype=dtype)

    # --- HF view (llama family) ---------------------------------------------------------------

    def to_hf_config(self) -> dict[str, Any]:
        """An HF ``config.json``-style dict for this model; see ``gguf_hf.gguf_to_hf_config``."""
        from .gguf_hf import gguf_to_hf_config

        return gguf_to_hf_config(self)

    def weights(self, dtype: torch.dtype | None = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs in HF layout; see ``gguf_hf.gguf_hf_weights``."""
        from .gguf_hf import gguf_hf_weights

        return gguf_hf_weights(self, dtype=dtype)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"
