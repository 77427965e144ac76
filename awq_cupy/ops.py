"""GPU operations on CuPy arrays: validation at the public boundary, then one kernel launch.

Kernels receive bare pointers, so every check (array type, device, dtype, shape, contiguity, alignment) happens
here, with errors that name the value and the rule. Launches go to the caller's current CuPy stream; nothing here
synchronises.
"""
from __future__ import annotations

import numpy as np

from ._array import bfloat16_dtype, is_cupy
from .jit import as_i32

__all__ = ["dequantize_gemm", "dtype_name", "activation_dtype"]

_BF16_NOTE = ("bfloat16 needs ml_dtypes (pip install ml_dtypes) for a typed array; without it pass "
              "dtype='bfloat16' and use uint16 arrays holding bf16 bit patterns")


def dtype_name(dtype) -> str:
    """'float16' or 'bfloat16' for the accepted spellings (np.float16, 'float16', 'half', ml_dtypes.bfloat16,
    'bfloat16', 'bf16'); TypeError otherwise."""
    if isinstance(dtype, str):
        s = dtype.lower()
        if s in ("float16", "half", "fp16", "f16"):
            return "float16"
        if s in ("bfloat16", "bf16"):
            return "bfloat16"
        raise TypeError(f"dtype={dtype!r} is not supported; use float16 or bfloat16")
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype={dtype!r} is not supported; use float16 or bfloat16") from None
    if d == np.float16:
        return "float16"
    bf = bfloat16_dtype()
    if bf is not None and d == bf:
        return "bfloat16"
    raise TypeError(f"dtype={d} is not supported; use float16 or bfloat16")


def numpy_dtype(name: str):
    """The array dtype used to hold ``name`` ('float16' or 'bfloat16'); bf16 is uint16 without ml_dtypes."""
    if name == "float16":
        return np.dtype(np.float16)
    bf = bfloat16_dtype()
    return bf if bf is not None else np.dtype(np.uint16)


def activation_dtype(a, what: str, dtype=None) -> str:
    """The 16-bit float kind of array ``a``: its own dtype (float16 / ml_dtypes bfloat16), or ``dtype`` when
    ``a`` holds raw uint16 bf16 bits."""
    if a.dtype == np.uint16:
        if dtype is None or dtype_name(dtype) != "bfloat16":
            raise TypeError(f"{what} has dtype uint16; pass dtype='bfloat16' if it holds bf16 bit patterns")
        return "bfloat16"
    name = dtype_name(a.dtype) if a.dtype in (np.float16, bfloat16_dtype()) else None
    if name is None:
        raise TypeError(f"{what} has dtype {a.dtype}; expected float16 or bfloat16 ({_BF16_NOTE})")
    if dtype is not None and dtype_name(dtype) != name:
        raise TypeError(f"{what} has dtype {a.dtype} but dtype={dtype!r} was requested")
    return name


def require_cupy(a, what: str, device_id: int | None = None):
    if not is_cupy(a):
        raise TypeError(f"{what} must be a cupy.ndarray on the GPU, got {type(a).__module__}.{type(a).__name__}"
                        " (move it with cupy.asarray)")
    if device_id is not None and a.device.id != device_id:
        raise ValueError(f"{what} is on GPU {a.device.id} but the other operands are on GPU {device_id}")
    return a


def contiguous(a, what: str):
    """C-contiguous, 16-byte aligned version of ``a`` (a copy only when needed; weights, not hot-path data)."""
    import cupy

    if not a.flags.c_contiguous:
        return cupy.ascontiguousarray(a)   # fresh allocations are 256-byte aligned
    if a.data.ptr % 16:
        return a.copy()
    return a


def _check_packed_gemm(qweight, qzeros, scales, group_size):
    """Validate raw AutoAWQ gemm tensors on the GPU; returns (K, N, G, scale dtype name)."""
    from .formats import resolve_group_size

    dev = require_cupy(qweight, "qweight").device.id
    require_cupy(qzeros, "qzeros", dev)
    require_cupy(scales, "scales", dev)
    for name, a in (("qweight", qweight), ("qzeros", qzeros)):
        if a.dtype not in (np.int32, np.uint32):
            raise TypeError(f"{name} must be int32 (or uint32) packed words, got {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    if scales.ndim != 2:
        raise ValueError(f"scales must be 2-D [K/G, N], got shape {scales.shape}")
    scale_kind = activation_dtype(scales, "scales")
    K, N8 = qweight.shape
    N = 8 * N8
    G = resolve_group_size(group_size, K)
    if scales.shape != (K // G, N):
        raise ValueError(f"scales shape {scales.shape} disagrees with qweight {qweight.shape} and "
                         f"group_size={group_size}: expected {(K // G, N)}")
    if qzeros.shape != (K // G, N8):
        raise ValueError(f"qzeros shape {qzeros.shape} disagrees with qweight {qweight.shape} and "
                         f"group_size={group_size}: expected {(K // G, N8)}")
    return K, N, G, scale_kind


def dequantize_gemm(qweight, qzeros, scales, group_size, *, dtype="float16", out=None):
    """Dense ``W [K, N]`` from AutoAWQ ``gemm`` tensors on the GPU: ``(Q - Z) * S`` in fp32, one rounding.

    ``qweight`` int32 [K, N/8], ``qzeros`` int32 [K/G, N/8], ``scales`` fp16 (or bf16) [K/G, N], all CuPy arrays
    on one device; ``dtype`` float16 or bfloat16 (bf16 output is ``ml_dtypes.bfloat16`` when ml_dtypes is
    installed, else uint16 bit patterns). ``out``, if given, must be a C-contiguous [K, N] array of that dtype.
    Runs on the current stream, without synchronising. Bit-exact with ``reference.dequantize(..., float16)``.
    """
    import cupy

    from .kernels import dequant_variant, kernel

    K, N, G, scale_kind = _check_packed_gemm(qweight, qzeros, scales, group_size)
    out_kind = dtype_name(dtype)
    dev = qweight.device.id
    if out is None:
        out = cupy.empty((K, N), dtype=numpy_dtype(out_kind))
    else:
        require_cupy(out, "out", dev)
        if out.shape != (K, N) or out.dtype != numpy_dtype(out_kind):
            raise ValueError(f"out must be [{K}, {N}] of {numpy_dtype(out_kind)}, got {out.shape} {out.dtype}")
        if not out.flags.c_contiguous or out.data.ptr % 16:
            raise ValueError("out must be C-contiguous and 16-byte aligned")
    if K == 0 or N == 0:
        return out
    qweight, qzeros, scales = (contiguous(a, n) for a, n in ((qweight, "qweight"), (qzeros, "qzeros"),
                                                             (scales, "scales")))
    words = K * (N // 8)
    threads = 256
    blocks = min((words + threads - 1) // threads, 65535 * 8)
    k = kernel("dequant", dequant_variant(out_kind, scale_kind), dev)
    with cupy.cuda.Device(dev):
        k.launch((blocks,), (threads,), (qweight, qzeros, scales, out, as_i32(K), as_i32(N), as_i32(G)))
    return out
