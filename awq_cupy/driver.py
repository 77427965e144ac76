"""cuLaunchKernelEx through ctypes (CuPy has no binding for it): prepared launches.

Driver API, CUDA 12+ struct layouts (CUlaunchConfig; CUlaunchAttribute with a 64-byte value union). Every kernel
argument gets an 8-byte parameter slot (``arg_bits``). Imports nothing of awq_cupy: ``jit`` (a one-off PDL launch
is a ``Launch`` fired once) and ``launch`` (matmul's prepared calls) both build on it.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np

__all__ = ["Launch", "LaunchConfig", "LaunchAttribute", "TensorMap", "launch_attributes", "arg_bits", "cuda_driver"]


CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_libcuda = None
_launch_fn = None         # cuLaunchKernelEx taking four addresses as plain ints (the prepared launches' path)
_attr_sets: dict = {}     # (pdl, cluster) -> ctypes array of attributes, kept alive for the process


def cuda_driver():
    """libcuda, loaded at the first launch, with ``_launch_fn``: its cuLaunchKernelEx taking four addresses as
    plain ints (config, function, parameter array, extra)."""
    global _libcuda, _launch_fn
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        _launch_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p)(ctypes.cast(lib.cuLaunchKernelEx, ctypes.c_void_p).value)
        _libcuda = lib
    return _libcuda


def launch_attributes(pdl: bool, cluster: tuple | None):
    """(array, count) of the launch attributes for PDL and / or cluster dimensions, built once per set (launches
    use PDL alone; bench/probes/cluster_occupancy.py asks for cluster shapes)."""
    key = (bool(pdl), tuple(cluster) if cluster else None)
    got = _attr_sets.get(key)
    if got is None:
        values = []
        if pdl:   # programmaticStreamSerializationAllowed = 1
            values.append((CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, struct.pack("<i", 1)))
        if cluster:
            c = tuple(cluster) + (1,) * (3 - len(cluster))
            values.append((CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, struct.pack("<3I", *c)))
        arr = (LaunchAttribute * max(1, len(values)))()
        for a, (ident, payload) in zip(arr, values):
            a.id = ident
            ctypes.memmove(ctypes.addressof(a) + LaunchAttribute.value.offset, payload, len(payload))
        got = _attr_sets[key] = (arr, len(values))
    return got


_INT_SCALARS = (np.int32, np.int64, np.uint32, np.uint64)
_MASK64 = (1 << 64) - 1


# cuTensorMapEncodeTiled's enums (cuda.h, CUDA 12): 2-byte elements as raw bits, no interleave, the 128-byte swizzle,
# 256-byte L2 promotion, zeros outside the tensor
_TMAP_UINT16, _TMAP_INTERLEAVE_NONE, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, _TMAP_FILL_ZERO = 1, 0, 3, 3, 0


class TensorMap:
    """A ``CUtensorMap`` kernel argument (passed by value, ``__grid_constant__``; kernels_cu/common.cuh TensorMap):
    a row-major ``[rows, cols]`` array of 2-byte elements read in boxes of ``box_rows`` x ``box_cols`` with the
    128-byte swizzle (``box_cols`` x 2 bytes must be 128) and zeros outside the array. ``point(ptr)`` encodes it for
    the array at device address ``ptr`` (16-byte aligned; the rows ``cols`` x 2 bytes apart, a multiple of 16); a
    ``Launch`` passes the 128 bytes as they stand at ``fire()``."""

    __slots__ = ("rows", "cols", "_buf", "address", "ptr", "_call", "_box")

    def __init__(self, rows: int, cols: int, box_rows: int, box_cols: int):
        if not (0 < rows < 1 << 32 and 0 < cols < 1 << 32):
            raise ValueError(f"tensor map of {rows} x {cols}: both sizes must be in 1..2^32-1")
        if box_cols * 2 != 128 or not 0 < box_rows <= 256:
            raise ValueError(f"tensor map box {box_rows} x {box_cols}: 64 columns (128 bytes) and 1..256 rows")
        if (cols * 2) % 16:
            raise ValueError(f"tensor map rows of {cols} 2-byte elements: the row pitch must be a multiple of 16 "
                             f"bytes")
        self.rows, self.cols = rows, cols
        self._buf = (ctypes.c_uint64 * 24)()   # 128 bytes at a 64-byte boundary inside
        self.address = -(-ctypes.addressof(self._buf) // 64) * 64
        self.ptr = None
        self._call = None   # the encoder, bound to this map's sizes at the first point()
        self._box = (box_rows, box_cols)

    def _encoder(self):
        lib = cuda_driver()
        dims = (ctypes.c_uint64 * 2)(self.cols, self.rows)
        strides = (ctypes.c_uint64 * 1)(self.cols * 2)
        box = (ctypes.c_uint32 * 2)(self._box[1], self._box[0])
        elem = (ctypes.c_uint32 * 2)(1, 1)
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int]
        fixed = (ctypes.addressof(dims), ctypes.addressof(strides), ctypes.addressof(box), ctypes.addressof(elem),
                 _TMAP_INTERLEAVE_NONE, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, _TMAP_FILL_ZERO)
        addr = self.address

        def encode(ptr: int, _keep=(dims, strides, box, elem)) -> int:
            return fn(addr, _TMAP_UINT16, 2, ptr, *fixed)

        return encode

    def point(self, ptr: int) -> None:
        """Encode the map for the array at ``ptr`` (a no-op when it already points there)."""
        if ptr == self.ptr:
            return
        if ptr % 16:
            raise ValueError(f"tensor map address {ptr:#x}: must be 16-byte aligned")
        if self._call is None:
            self._call = self._encoder()
        err = self._call(ptr)
        if err:
            self.ptr = None
            raise _launch_error(err, f"a {self.rows} x {self.cols} tensor map", "cuTensorMapEncodeTiled")
        self.ptr = ptr

    def __repr__(self) -> str:
        return f"TensorMap({self.rows} x {self.cols}, ptr={self.ptr and hex(self.ptr)})"


def arg_bits(a) -> int:
    """One kernel argument as the 64-bit little-endian word whose first bytes are its value: device arrays by
    pointer, numpy integer scalars at their own width (the low bytes), float32 by bit pattern. Each argument gets
    an 8-byte slot, so a 4-byte argument is read from the low half of its slot. A ``TensorMap`` is passed from its
    own buffer; its slot stays 0."""
    if isinstance(a, TensorMap):
        return 0
    if isinstance(a, np.generic):
        if isinstance(a, _INT_SCALARS):
            return int(a) & _MASK64
        if isinstance(a, np.float32):
            return int(np.asarray(a).view(np.uint32))
        raise TypeError(f"kernel argument {a!r}: numpy scalars of dtype {a.dtype} are not supported")
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is None:
        raise TypeError(f"kernel argument of type {type(a).__name__} is not a device array or numpy scalar")
    return int(ptr)


def _launch_error(err: int, what: str, call: str = "cuLaunchKernelEx") -> RuntimeError:
    name = ctypes.c_char_p()
    _libcuda.cuGetErrorName(err, ctypes.byref(name))
    return RuntimeError(f"{call} failed for {what}: CUresult {err} ({(name.value or b'unknown').decode()})")


def _dims(d) -> tuple[int, int, int]:
    d = tuple(d)
    return d + (1,) * (3 - len(d))


class Launch:
    """One kernel launch prepared once: function, grid, block, dynamic shared memory, stream, PDL attribute and a
    parameter buffer (8-byte slots, ``arg_bits``). ``fire()`` launches it as it stands; callers patch pointer
    slots first (``slots[i] = ptr``). Raises RuntimeError naming the kernel when the driver refuses."""

    __slots__ = ("kernel", "slots", "maps", "_params", "_cfg", "_attrs", "_args")

    def __init__(self, kernel, grid, block, args, *, smem: int = 0, pdl: bool = False, stream: int = 0):
        for a in args:   # Python scalars would need a width: demand numpy ones, as Kernel.launch does
            if isinstance(a, (int, float, bool)):
                raise TypeError(f"kernel {kernel.name}: scalar argument {a!r} must be a numpy scalar "
                                f"(np.int32/np.float32/...), not a Python {type(a).__name__}")
        cuda_driver()
        kernel.ensure_dynamic_smem(smem)
        n = len(args)
        self.kernel = kernel
        self.slots = (ctypes.c_uint64 * max(1, n))(*[arg_bits(a) for a in args])
        base = ctypes.addressof(self.slots)
        self._params = (ctypes.c_void_p * max(1, n))(*range(base, base + 8 * n, 8))
        # tensor maps: parameter -> map, passed from the map's own 128 bytes
        self.maps = {i: a for i, a in enumerate(args) if isinstance(a, TensorMap)}
        for i, m in self.maps.items():
            self._params[i] = m.address
        attrs, nattrs = launch_attributes(pdl, None)
        self._attrs = attrs
        g, b = _dims(grid), _dims(block)
        self._cfg = LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], smem, stream,
                                 ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), nattrs)
        self._args = (ctypes.addressof(self._cfg), kernel.func_ptr, ctypes.addressof(self._params))

    def fire(self) -> None:
        c, f, p = self._args
        err = _launch_fn(c, f, p, None)
        if err:
            raise _launch_error(err, self.kernel.name)

    def __repr__(self) -> str:
        cfg = self._cfg
        return (f"Launch({self.kernel.name!r}, grid=({cfg.gridDimX}, {cfg.gridDimY}, {cfg.gridDimZ}), "
                f"block={cfg.blockDimX}, smem={cfg.sharedMemBytes}, pdl={bool(cfg.numAttrs)})")
