"""The public GPU operations on CuPy arrays: validation at the boundary, then prepared kernel launches.

Kernels receive bare pointers, so every check (array type, device, dtype, shape, contiguity, alignment) happens
here, with errors that name the value and the rule. Launches go to the caller's current CuPy stream; nothing here
synchronises.

``matmul`` plans once per call shape: the first call of a weight with a given (M, stream, bias or not,
batch_invariant) asks ``plans`` for the path and launch plan and ``launch`` for the prepared launches, and keeps
them on the weight (at most ``PLAN_CACHE_SIZE`` shapes, the oldest dropped first); later calls check their
arguments in O(1), patch the pointers and launch. ``settings.reload()`` drops every cached plan.
"""
from __future__ import annotations

import threading

import numpy as np

from . import launch
from ._array import is_cupy, require_gpu
from .dtypes import BF16_NOTE, activation_dtype, dtype_name, numpy_dtype  # noqa: F401  (re-exported)
from .jit import as_i32
from .weight import QuantizedWeight

__all__ = ["dequantize_gemm", "dequantize", "matmul", "bind", "gemm", "BoundMatmul", "PLAN_CACHE_SIZE"]

def require_cupy(a, what: str, device_id: int | None = None):
    if not is_cupy(a):
        raise TypeError(f"{what} must be a cupy.ndarray on the GPU, got {type(a).__module__}.{type(a).__name__}"
                        " (move it with cupy.asarray)")
    if device_id is not None and a.device.id != device_id:
        raise ValueError(f"{what} is on GPU {a.device.id} but the other operands are on GPU {device_id}")
    return a


def contiguous(a):
    """C-contiguous, 16-byte aligned version of ``a``; copies only when ``a`` is neither (kernels use 16-byte
    vector loads and see only the pointer)."""
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
    require_gpu("awq_cupy.dequantize_gemm")
    import cupy

    from .kernels import DequantVariant, kernel

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
    qweight, qzeros, scales = (contiguous(a) for a in (qweight, qzeros, scales))
    words = K * (N // 8)
    threads = 256
    blocks = min((words + threads - 1) // threads, 65535 * 8)
    k = kernel(DequantVariant(out_kind, scale_kind), dev)
    with cupy.cuda.Device(dev):
        k.launch((blocks,), (threads,), (qweight, qzeros, scales, out, as_i32(K), as_i32(N), as_i32(G)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------------------------------------
PLAN_CACHE_SIZE = 64     # prepared call shapes kept per weight (a decode loop uses one or two)

_rt = None               # (cupy.ndarray, get_current_stream, get_device_id, cupy.empty), bound at the first call
_cache_lock = threading.Lock()


def _runtime():
    global _rt
    try:
        import cupy
    except ImportError:     # no weight can exist then either; say what is missing rather than "no module"
        require_gpu("awq_cupy.matmul")
        raise
    from cupy.cuda import device

    _rt = (cupy.ndarray, cupy.cuda.get_current_stream, device.get_device_id, cupy.empty)
    return _rt


def matmul(x, w, bias=None, out=None, *, batch_invariant: bool = False):
    """``y = x @ W (+ bias)`` for a ``QuantizedWeight`` ``w`` on the GPU, fp32 accumulation, one final rounding.

    ``x``: CuPy array ``[..., K]`` of ``w.dtype`` (float16, or bfloat16 as ``ml_dtypes.bfloat16``; raw uint16 bf16
    bit patterns are accepted for a bf16 weight). A non-contiguous or misaligned ``x`` is copied first.
    ``bias``: ``[N]`` of the same dtype, or None. ``out``: optional C-contiguous, 16-byte aligned ``[..., N]``
    output that must not overlap ``x``. Returns ``y [..., N]`` of x's dtype; M = 0 rows give an empty result.

    Runs on the caller's current CuPy stream without synchronising, and is capturable in a CUDA graph (under
    capture pass ``out=`` and keep it alive with the graph; ``awq_cupy.capture`` does both). The launch plan is
    made at a call shape's first call and kept on the weight (``PLAN_CACHE_SIZE``); later calls only check their
    arguments and launch. On compute capability 9.0 the kernels launch with programmatic dependent launch
    (``plans.uses_pdl``): they may start before the previous awq_cupy kernel of the stream has finished and read
    ``w`` meanwhile, so that kernel must not be the one writing ``w``.

    Dispatch by M (``plans.choose_path``, table ``awq_cupy.dispatch``): small M (up to 16 on the H200, and up to 32
    on the layer shapes ``plans.gemv_wide_takes`` gives it) runs the swapped-operand tensor-core GEMV
    (kernels_cu/gemv_tc.cu; exact (q - z) in the mma, scales applied to fp32 group sums, but for the variant of
    16-column block pairs at 9..16 rows, which multiplies by (q - z) * s rounded once like the GEMM
    (``plans.rounds_weights``); partial sums added in a fixed order: bitwise reproducible run to run); middle M
    runs the tensor-core GEMM (kernels_cu/gemm_wg.cu with Hopper wgmma on compute capability 9.0,
    kernels_cu/gemm_tc.cu with mma.sync elsewhere; (q - z) * s rounded once in x's dtype, fp32 split-K partials
    added in a fixed order); large fp16 M runs dequantize + cuBLAS (a temporary dense [K, N] weight), except while
    the stream is capturing a CUDA graph, where the fused GEMM runs instead because CuPy cannot capture cuBLAS.

    Batch invariance: by default a row's result can depend on M (the kernel and its split-K count are chosen
    from M). With ``batch_invariant=True`` one kernel with a split count chosen from (K, N) alone runs for every
    M, so each row's output is bitwise independent of the other rows and of M.
    """
    try:
        K, N, dev, dt = w.K, w.N, w.device, w._xdtype
    except AttributeError:
        raise TypeError(f"w must be an awq_cupy.QuantizedWeight, got {type(w).__name__}") from None
    rt = _rt if _rt is not None else _runtime()
    # The O(1) checks of the common case; anything else (errors included) goes through _check_x.
    if type(x) is rt[0] and x.dtype is dt and x._c_contiguous:
        shape = x.shape
        xd = x.data
        xp = xd.ptr
        nd = len(shape)
        M = shape[0] if nd == 2 else 1 if nd == 1 else _rows(shape)
        if nd == 0 or shape[-1] != K or xp & 15 or xd.device_id != dev or M == 0:
            x, M = _check_x(x, w)
            shape, xp = x.shape, x.data.ptr
    else:
        x, M = _check_x(x, w)
        shape, xp = x.shape, x.data.ptr
    if rt[2]() != dev:
        import cupy

        with cupy.cuda.Device(dev):
            return matmul(x, w, bias, out, batch_invariant=batch_invariant)
    bp = 0
    if bias is not None:
        bias = _check_bias(bias, w, x.dtype)
        bp = bias.data.ptr
    if out is None:
        out = rt[3](shape[:-1] + (N,), dtype=x.dtype)
        yp = out.data.ptr
    elif type(out) is rt[0] and out.dtype is x.dtype and out._c_contiguous and out.shape == shape[:-1] + (N,):
        od = out.data
        yp = od.ptr
        isz = out.itemsize
        if yp & 15 or od.device_id != dev or (yp < xp + M * K * isz and xp < yp + M * N * isz):
            _check_out(out, x, xp, shape, M, K, N, dev)    # raises, naming the rule
    else:
        yp = _check_out(out, x, xp, shape, M, K, N, dev)
    if M == 0:
        return out
    _run(x, w, bias, out, M, xp, yp, bp, batch_invariant)
    return out


def _run(x, w, bias, out, M: int, xp: int, yp: int, bp: int, batch_invariant: bool) -> None:
    """The checked call: the prepared call of its shape on the current stream (made at its first call), fired with
    the pointers; the dequantize + cuBLAS path runs through ``_run_cublas``."""
    key = (M, _rt[1]().ptr, bp != 0, batch_invariant)
    pc = w._calls.get(key)
    if pc is None:
        pc = _prepare(w, key)
    if pc.capture_safe:
        pc.run(xp, yp, bp)
    else:
        _run_cublas(x, w, bias, out, M, key)


def _rows(shape) -> int:
    m = 1
    for d in shape[:-1]:
        m *= d
    return m


def _check_x(x, w):
    """Full validation of ``x`` for ``w``: (x C-contiguous and 16-byte aligned, copied if it was not; its rows)."""
    require_cupy(x, "x", w.device)
    kind = "bfloat16" if x.dtype == np.uint16 and w.dtype == "bfloat16" else activation_dtype(x, "x")
    if kind != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the weight was prepared for {w.dtype}; use w.astype({kind!r})")
    if x.ndim < 1 or x.shape[-1] != w.K:
        raise ValueError(f"x has shape {x.shape}; its last dimension must equal K={w.K}")
    return contiguous(x), _rows(x.shape)


def _check_bias(bias, w, dtype):
    """``bias`` checked for ``w`` and activations of ``dtype``; copied when not contiguous and aligned."""
    if type(bias) is not _rt[0] or bias.shape != (w.N,) or bias.dtype is not dtype or not bias._c_contiguous \
            or bias.data.ptr & 15 or bias.data.device_id != w.device:
        require_cupy(bias, "bias", w.device)
        if bias.shape != (w.N,):
            raise ValueError(f"bias has shape {bias.shape}, expected ({w.N},)")
        if bias.dtype != dtype:
            raise TypeError(f"bias has dtype {bias.dtype}, expected {dtype} like x")
        bias = contiguous(bias)
    return bias


def _check_out(out, x, xp: int, shape, M: int, K: int, N: int, dev: int) -> int:
    """The output's pointer after its checks (type, device, shape, dtype, layout, no overlap with x)."""
    if type(out) is not _rt[0]:
        require_cupy(out, "out", dev)
    want = shape[:-1] + (N,)
    if out.shape != want or out.dtype != x.dtype:
        raise ValueError(f"out must have shape {want} and dtype {x.dtype}, got {out.shape} {out.dtype}")
    od = out.data
    yp = od.ptr
    if od.device_id != dev:
        raise ValueError(f"out is on GPU {od.device_id} but the other operands are on GPU {dev}")
    if not out._c_contiguous or yp & 15:
        raise ValueError("out must be C-contiguous and 16-byte aligned")
    isz = out.itemsize
    if yp < xp + M * K * isz and xp < yp + M * N * isz:
        raise ValueError("out must not overlap x")
    return yp


def _prepare(w, key):
    """The prepared call for ``key`` = (M, stream, bias, batch_invariant): made and cached outside a graph
    capture; while the stream captures (or inside ``launch.capture_scope``) made for the capture and not cached,
    so that it neither loads modules mid-capture nor outlives the capture's workspaces."""
    M, stream, _, batch_invariant = key
    if launch.in_capture_scope() or launch.is_capturing():
        return launch.prepare_call(w, M, w.dtype, stream, batch_invariant=batch_invariant, capturing=True)
    pc = launch.prepare_call(w, M, w.dtype, stream, batch_invariant=batch_invariant)
    with _cache_lock:
        calls = w._calls
        while len(calls) >= PLAN_CACHE_SIZE:
            del calls[next(iter(calls))]
        calls[key] = pc
    return pc


def _run_cublas(x, w, bias, out, M: int, key) -> None:
    """Dequantize + cuBLAS (fp16, large M): W is x's dtype rounded once, like the fused GEMM's operand; a bias is
    added after cuBLAS has rounded x @ W (a second rounding). While the stream captures a graph, the fused GEMM
    instead (CuPy cannot capture cuBLAS)."""
    import cupy

    if launch.is_capturing():
        pc = launch.prepare_call(w, M, w.dtype, key[1], batch_invariant=key[3], capturing=True)
        pc.run(x.data.ptr, out.data.ptr, 0 if bias is None else bias.data.ptr)
        return
    y2 = out.reshape(M, w.N)
    cupy.matmul(x.reshape(M, w.K), dequantize(w), out=y2)
    if bias is not None:
        y2 += bias


def bind(w, shape, *, bias=None, batch_invariant: bool = False) -> "BoundMatmul":
    """``matmul`` bound to weight ``w``, one input shape (an int M for ``[M, K]``, or a tuple ``[..., K]``) and a
    bias: a callable ``f(x, out=None)`` with the fewest checks per call (``BoundMatmul``)."""
    return BoundMatmul(w, shape, bias=bias, batch_invariant=batch_invariant)


class BoundMatmul:
    """``matmul`` bound to one weight, one input shape and one bias: ``f(x, out=None)`` for the tightest loops.

    Made by ``awq_cupy.bind(w, shape, bias=None, batch_invariant=False)``. Its rules: ``x`` must have exactly
    the bound shape (``[M, K]`` for an int M), the weight's dtype, C-contiguous and 16-byte aligned storage on the
    weight's device; ``out``, if given, exactly ``[..., N]`` of that dtype, C-contiguous, aligned and not
    overlapping ``x``. Anything else goes through ``matmul``'s full checks (and its errors). The bias is fixed at
    binding and must stay alive and unchanged in place of the one bound. The output is bitwise ``matmul``'s. Runs
    on the current stream at each call, with the weight's cached plans (``settings.reload`` drops them)."""

    __slots__ = ("w", "bias", "batch_invariant", "x_shape", "out_shape", "M", "_dtype", "_bp")

    def __init__(self, w, shape, *, bias=None, batch_invariant: bool = False):
        if not isinstance(w, QuantizedWeight):
            raise TypeError(f"w must be an awq_cupy.QuantizedWeight, got {type(w).__name__}")
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (int(shape), w.K)
        elif isinstance(shape, tuple) and shape and all(isinstance(d, (int, np.integer)) for d in shape):
            shape = tuple(int(d) for d in shape)
        else:
            raise TypeError(f"shape={shape!r}: an int M (x is [M, K]) or a tuple [..., K]")
        if shape[-1] != w.K or any(d < 0 for d in shape):
            raise ValueError(f"shape={shape}: its last dimension must equal K={w.K} and none may be negative")
        self.w, self.batch_invariant, self.x_shape = w, bool(batch_invariant), shape
        self.out_shape = shape[:-1] + (w.N,)
        self.M = _rows(shape)
        if self.M == 0:
            raise ValueError(f"shape={shape} has no rows: nothing to bind")
        self._dtype = w._xdtype
        if _rt is None:
            _runtime()
        if bias is not None:
            bias = _check_bias(bias, w, w._xdtype)
        self.bias = bias
        self._bp = 0 if bias is None else bias.data.ptr

    def __call__(self, x, out=None):
        rt = _rt
        if type(x) is not rt[0] or x.shape != self.x_shape or x.dtype is not self._dtype or not x._c_contiguous:
            return matmul(x, self.w, self.bias, out, batch_invariant=self.batch_invariant)
        xd = x.data
        xp = xd.ptr
        w = self.w
        if xp & 15 or xd.device_id != w.device or rt[2]() != w.device:
            return matmul(x, w, self.bias, out, batch_invariant=self.batch_invariant)
        if out is None:
            out = rt[3](self.out_shape, dtype=self._dtype)
            yp = out.data.ptr
        elif (type(out) is rt[0] and out.shape == self.out_shape and out.dtype is self._dtype
              and out._c_contiguous):
            yp = out.data.ptr
            isz = out.itemsize
            if yp & 15 or out.data.device_id != w.device or (
                    yp < xp + self.M * w.K * isz and xp < yp + self.M * w.N * isz):
                return matmul(x, w, self.bias, out, batch_invariant=self.batch_invariant)
        else:
            return matmul(x, w, self.bias, out, batch_invariant=self.batch_invariant)
        _run(x, w, self.bias, out, self.M, xp, yp, self._bp, self.batch_invariant)
        return out

    def __repr__(self) -> str:
        return (f"BoundMatmul({self.w!r}, x_shape={self.x_shape}, bias={self.bias is not None}, "
                f"batch_invariant={self.batch_invariant})")


def dequantize(w, dtype=None, *, out=None):
    """Dense ``W [K, N]``: exactly the values a matmul multiplies, ``(q - z) * s`` rounded once.

    ``w`` a ``QuantizedWeight``: on its GPU, in the weight's dtype (``dtype`` defaults to it; another dtype goes
    through ``w.astype``), ``out`` an optional C-contiguous CuPy array. ``w`` a checkpoint ``QuantizedLayer`` (any
    format) or ``quantize()``'s ``QuantizedTensors``: on the CPU, a numpy array of ``dtype`` (default float16;
    float32 gives the unrounded values), no GPU needed; ``out`` is not accepted there."""
    if not isinstance(w, QuantizedWeight):
        return _dequantize_host(w, dtype, out)
    import cupy

    from .kernels import DequantTilesVariant, kernel

    kind = w.dtype if dtype is None else dtype_name(dtype)
    if kind != w.dtype:
        w = w.astype(kind)
    with cupy.cuda.Device(w.device):
        if out is None:
            out = cupy.empty((w.K, w.N), dtype=numpy_dtype(kind))
        else:
            require_cupy(out, "out", w.device)
            if out.shape != (w.K, w.N) or out.dtype != numpy_dtype(kind) or not out.flags.c_contiguous:
                raise ValueError(f"out must be a C-contiguous [{w.K}, {w.N}] array of {numpy_dtype(kind)}")
        blocks = w.NT * w.KS
        k = kernel(DequantTilesVariant(kind), w.device)
        k.launch((min(-(-blocks // 4), 1 << 20),), (128,),
                 (w.qtiles, w.scales, w.zeros, out, as_i32(w.K), as_i32(w.N), as_i32(w.NT), as_i32(w.KS),
                  as_i32(w.group_size), as_i32(w.NG)))
    return out


def _dequantize_host(w, dtype, out):
    from .checkpoint import QuantizedLayer
    from .quantize import QuantizedTensors

    if isinstance(w, QuantizedLayer):
        w = w.unpack()
    if not isinstance(w, QuantizedTensors):
        raise TypeError(f"w must be an awq_cupy.QuantizedWeight (GPU), a checkpoint QuantizedLayer or "
                        f"QuantizedTensors (CPU), got {type(w).__name__}")
    if out is not None:
        raise TypeError("out= is for a QuantizedWeight on the GPU; the CPU route returns a new numpy array")
    return w.dequantize(np.float16 if dtype is None else dtype)


def gemm(x, qweight, qzeros, scales, group_size, bias=None, *, out=None):
    """``matmul`` on raw AutoAWQ ``gemm`` tensors (CuPy arrays). It repacks the weight on every call (a
    load-time cost); for repeated calls build ``QuantizedWeight.from_gemm`` once and use ``matmul``."""
    require_gpu("awq_cupy.gemm")
    require_cupy(x, "x")
    kind = "bfloat16" if x.dtype == np.uint16 else activation_dtype(x, "x")
    K, N, G, _ = _check_packed_gemm(qweight, qzeros, scales, group_size)
    w = QuantizedWeight.from_gemm(qweight, qzeros, scales, group_size, dtype=kind, device=qweight.device.id)
    return matmul(x, w, bias=bias, out=out)
