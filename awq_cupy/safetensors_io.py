"""A small, lazy safetensors reader and a streaming writer (numpy only, no torch).

Why not the ``safetensors`` package: its numpy API returns a copy of each tensor it reads (``load_file`` reads
the whole file), where a 40 GB checkpoint must open in milliseconds and stream to the GPU layer by layer from
the page cache; it raises on BF16 unless ml_dtypes was imported (this reader returns bit patterns then, with the
declared dtype at hand); and its errors name neither the file nor the tensor. The format is small (below), so reading it here costs ~300 lines.
The tests check both directions against that package (``tests/test_checkpoint.py``).

File format (https://github.com/huggingface/safetensors): 8 bytes little-endian unsigned header length ``n``,
then ``n`` bytes of UTF-8 JSON ``{name: {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the data buffer. Offsets are relative to the start of the data buffer.

Reading maps the file with ``np.memmap`` (read-only) the first time a tensor is requested; opening a file reads
only its header, so a 40 GB checkpoint costs nothing until its tensors are touched. Returned arrays are
read-only views into the mapping (``np.memmap`` instances); copy them to modify. Every header is validated
when the file is opened, and errors (``SafetensorsError``) name the file and the tensor.

BF16 (and the F8 types) have no numpy dtype. ``bf16="auto"`` returns them as ``ml_dtypes`` arrays when
ml_dtypes is importable and as raw bit patterns (uint16 / uint8) otherwise; ``"uint16"`` always returns bit
patterns, ``"ml_dtypes"`` requires ml_dtypes. ``SafetensorsFile.dtype_code(name)`` always gives the declared
dtype, so bit patterns are never ambiguous.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ._array import to_numpy

__all__ = [
    "SafetensorsError", "TensorInfo", "SafetensorsFile", "dtype_code_of", "write_file", "save_file",
    "BF16_MODES",
]

BF16_MODES = ("auto", "uint16", "ml_dtypes")

# Declared dtype -> numpy dtype for the types numpy has natively.
_NUMPY_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "U64": np.dtype("<u8"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# Declared dtype -> (ml_dtypes attribute, raw bit-pattern dtype) for the types numpy lacks.
_ML_DTYPES = {
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F8_E4M3": ("float8_e4m3fn", np.dtype("u1")),
    "F8_E5M2": ("float8_e5m2", np.dtype("u1")),
}
_ITEMSIZE = {**{k: v.itemsize for k, v in _NUMPY_DTYPES.items()}, **{k: v[1].itemsize for k, v in _ML_DTYPES.items()}}
# The reference implementation refuses headers above 100 MB; a bigger length means a corrupted file.
_MAX_HEADER_BYTES = 100_000_000


class SafetensorsError(ValueError):
    """A safetensors file is truncated, corrupted or uses something this reader does not support."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str                   # declared safetensors dtype code, e.g. "F16", "BF16", "I32"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _ml_dtypes_module():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


class SafetensorsFile:
    """Lazy read-only view of one ``.safetensors`` file: ``keys()``, ``info(name)``, ``get(name)`` / ``[name]``."""

    def __init__(self, path, *, bf16: str = "auto"):
        if bf16 not in BF16_MODES:
            raise ValueError(f"{bf16=} must be one of {BF16_MODES}")
        if bf16 == "ml_dtypes" and _ml_dtypes_module() is None:
            raise ImportError("bf16='ml_dtypes' needs the ml_dtypes package (pip install ml_dtypes)")
        self.path = Path(path)
        self.bf16 = bf16
        self._mmap = None
        self.metadata, self._infos, self._file_size = _read_header(self.path)

    # -- mapping-like access -------------------------------------------------------------------------------------
    def keys(self):
        return self._infos.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __getitem__(self, name: str):
        return self.get(name)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    def dtype_code(self, name: str) -> str:
        """The declared safetensors dtype, e.g. ``"BF16"`` even when the array is returned as uint16."""
        return self.info(name).dtype

    def numpy_dtype(self, name: str) -> np.dtype:
        """The dtype ``get(name)`` returns (depends on ``bf16`` for BF16/F8 tensors)."""
        return self._numpy_dtype(self.info(name).dtype)

    @property
    def data_nbytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def get(self, name: str):
        """The tensor as a read-only array backed by the file mapping (no data is read until it is used)."""
        info = self.info(name)
        dtype = self._numpy_dtype(info.dtype)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
            if self._mmap.size < self._file_size:
                raise SafetensorsError(f"{self.path} shrank after it was opened (truncated while in use?)")
        raw = self._mmap[info.begin:info.end]
        return raw.view(dtype).reshape(info.shape)

    def close(self):
        """Drop this object's reference to the mapping (arrays already returned keep it alive)."""
        self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors, {self.data_nbytes} data bytes)"

    # -- internals -------------------------------------------------------------------------------------------------
    def _numpy_dtype(self, code: str) -> np.dtype:
        if code in _NUMPY_DTYPES:
            return _NUMPY_DTYPES[code]
        attr, raw = _ML_DTYPES[code]
        if self.bf16 == "uint16":
            return raw
        ml = _ml_dtypes_module()
        return raw if ml is None else np.dtype(getattr(ml, attr))


def _read_header(path: Path):
    """Parse and validate the header; returns (metadata, {name: TensorInfo} in data-offset order, file size)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(
                    f"{path}: file is {size} bytes, too small to hold the 8-byte header length (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: header length {n} exceeds the file size {size} (truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")

    data_start = 8 + n
    data_size = size - data_start
    infos = []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(f"{where}: entry must hold dtype, shape and data_offsets, got {entry!r}")
        code, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in _ITEMSIZE:
            raise SafetensorsError(
                f"{where}: unknown dtype {code!r} (supported: {', '.join(sorted(_ITEMSIZE))})")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                   for d in shape)):
            raise SafetensorsError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise SafetensorsError(f"{where}: data_offsets must be [begin, end], got {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise SafetensorsError(f"{where}: data_offsets {offs} are not 0 <= begin <= end")
        if end > data_size:
            raise SafetensorsError(
                f"{where}: data_offsets {offs} extend beyond the end of the file (data buffer is {data_size} "
                f"bytes; truncated?)")
        expected = math.prod(shape) * _ITEMSIZE[code]
        if end - begin != expected:
            raise SafetensorsError(
                f"{where}: data_offsets {offs} span {end - begin} bytes but dtype {code} x shape {shape} needs "
                f"{expected}")
        infos.append(TensorInfo(name, code, tuple(shape), data_start + begin, data_start + end))

    infos.sort(key=lambda i: (i.begin, i.end))
    for a, b in zip(infos, infos[1:]):
        if b.begin < a.end and b.nbytes and a.nbytes:
            raise SafetensorsError(f"{path}: tensors {a.name!r} and {b.name!r} overlap in the data buffer")
    return metadata, {i.name: i for i in infos}, size


# -- writing ---------------------------------------------------------------------------------------------------------

def dtype_code_of(dtype) -> str:
    """Safetensors dtype code of a numpy dtype (``ml_dtypes`` bfloat16/float8 included)."""
    dt = np.dtype(dtype)
    for code, ndt in _NUMPY_DTYPES.items():
        if dt.kind in "fiub" and dt.newbyteorder("<") == ndt:
            return code
    ml = _ml_dtypes_module()
    if ml is not None:
        for code, (attr, _raw) in _ML_DTYPES.items():
            if dt == np.dtype(getattr(ml, attr)):
                return code
    raise TypeError(f"dtype {dt} has no safetensors equivalent")


def write_file(path, specs: Sequence[TensorInfo | tuple], produce: Callable[[str], object],
               metadata: Mapping[str, str] | None = None) -> int:
    """Stream tensors into a safetensors file, one at a time, in the order of ``specs``.

    ``specs``: ``(name, dtype_code, shape)`` triples (or ``TensorInfo``), fixing the header before any data is
    produced. ``produce(name)`` returns the array (numpy or cupy); its itemsize and shape must match the spec (an
    array of the same itemsize is written bit for bit, so uint16 bit patterns can be declared ``"BF16"``).
    Keep tensors naturally aligned by ordering specs by itemsize, largest first, unless you know better.
    The file is written under a temporary name and renamed when complete. Returns the data size in bytes.
    """
    path = Path(path)
    entries = {}
    offset = 0
    order = []
    for spec in specs:
        name, code, shape = (spec.name, spec.dtype, spec.shape) if isinstance(spec, TensorInfo) else spec
        if code not in _ITEMSIZE:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {code!r}")
        if name in entries or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is duplicated or reserved")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * _ITEMSIZE[code]
        entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        order.append((name, code, shape, nbytes))
        offset += nbytes
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    header.update(entries)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)     # pad so the data buffer starts 8-byte aligned

    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, code, shape, nbytes in order:
                arr = np.asarray(to_numpy(produce(name)))
                if not arr.flags.c_contiguous:
                    arr = arr.copy(order="C")
                if tuple(arr.shape) != shape or arr.dtype.itemsize != _ITEMSIZE[code]:
                    raise ValueError(f"tensor {name!r}: produced {arr.dtype} {tuple(arr.shape)}, declared "
                                     f"{code} {shape}")
                if arr.dtype.byteorder == ">":
                    arr = arr.astype(arr.dtype.newbyteorder("<"))
                f.write(arr.reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return offset


def save_file(path, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None, *,
              dtypes: Mapping[str, str] | None = None) -> int:
    """Write a dict of arrays (numpy, cupy, ml_dtypes). ``dtypes`` overrides the declared code per name
    (e.g. ``{"w": "BF16"}`` for a uint16 bit-pattern array). Tensors are ordered by itemsize, largest first."""
    dtypes = dict(dtypes or {})
    unknown = set(dtypes) - set(tensors)
    if unknown:
        raise ValueError(f"dtypes names tensors that are not given: {sorted(unknown)}")
    specs = []
    for name, arr in tensors.items():
        code = dtypes.get(name) or dtype_code_of(arr.dtype)
        specs.append((name, code, tuple(arr.shape)))
    specs.sort(key=lambda s: (-_ITEMSIZE.get(s[1], 1), s[0]))
    return write_file(path, specs, tensors.__getitem__, metadata)
