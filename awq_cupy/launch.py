"""The launch layer: plans (``plans``) turned into prepared kernel launches that a call only has to fire.

A ``Launch`` holds everything of one kernel launch but the pointers that change from call to call: the function,
grid, block, dynamic shared memory, the stream, the launch attributes (programmatic dependent launch) and a
parameter buffer with one 8-byte slot per kernel argument. Firing it patches the x / output / bias slots and calls
``cuLaunchKernelEx`` through ctypes (CuPy has no binding for it). A ``PreparedCall`` is the launches of one matmul
call shape (the GEMV; the GEMM with its x-tile pass and split-K reduce) with their workspaces bound.

Workspaces (split-K partials, the wgmma GEMM's x tiles) are per (device, stream) and never freed, so that a CUDA
graph captured around a call keeps pointing at live memory; ``capture_scope`` gives a captured step workspaces
of its own.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

from . import plans
from .jit import as_i32
from .plans import GemmPlan, GemvPlan, Path

__all__ = ["Launch", "PreparedCall", "prepare_call", "prepare_gemv", "prepare_gemm", "run_gemv", "run_gemm",
           "launch_ex", "workspace", "capture_scope", "is_capturing", "sm_count", "NULL"]

NULL = np.uint64(0)      # a null pointer argument (also the placeholder of the slots patched per call)


# ----------------------------------------------------------------------------------------------------------------
# cuLaunchKernelEx through ctypes (driver API, CUDA 12+ struct layouts: CUlaunchConfig, CUlaunchAttribute with a
# 64-byte value union)
# ----------------------------------------------------------------------------------------------------------------
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
    """libcuda with cuLaunchKernelEx's signature declared (loaded at the first launch)."""
    global _libcuda, _launch_fn
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
            ctypes.cast(lib.cuLaunchKernelEx, ctypes.c_void_p).value)
        _launch_fn = fn
        _libcuda = lib
    return _libcuda


def launch_attributes(pdl: bool, cluster: tuple | None):
    """(array, count) of the launch attributes for PDL and / or cluster dimensions, built once per set (launches
    use PDL alone; bench/cluster_occupancy.py asks for cluster shapes)."""
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


def arg_bits(a) -> int:
    """One kernel argument as the 64-bit little-endian word whose first bytes are its value: device arrays by
    pointer, numpy integer scalars at their own width (the low bytes), float32 by bit pattern. Each argument gets
    an 8-byte slot, so a 4-byte argument is read from the low half of its slot."""
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


def _launch_error(err: int, what: str) -> RuntimeError:
    name = ctypes.c_char_p()
    _libcuda.cuGetErrorName(err, ctypes.byref(name))
    return RuntimeError(f"cuLaunchKernelEx failed for {what}: CUresult {err} ({(name.value or b'unknown').decode()})")


def _dims(d) -> tuple[int, int, int]:
    d = tuple(d)
    return d + (1,) * (3 - len(d))


class Launch:
    """One kernel launch prepared once: function, grid, block, dynamic shared memory, stream, PDL attribute and a
    parameter buffer (8-byte slots, ``arg_bits``). ``fire()`` launches it as it stands; callers patch pointer
    slots first (``slots[i] = ptr``). Raises RuntimeError naming the kernel when the driver refuses."""

    __slots__ = ("kernel", "slots", "_params", "_cfg", "_attrs", "_args")

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


def launch_ex(func_ptr: int, grid, block, args, smem: int = 0, pdl: bool = False, stream: int | None = None,
              name: str = "kernel") -> None:
    """A one-off cuLaunchKernelEx on the current CuPy stream (or ``stream``) with the PDL attribute if ``pdl``
    (``jit.Kernel.launch(pdl=True)``)."""
    import cupy

    lib = cuda_driver()
    attrs, nattrs = launch_attributes(pdl, None)
    n = len(args)
    slots = (ctypes.c_uint64 * max(1, n))(*[arg_bits(a) for a in args])
    base = ctypes.addressof(slots)
    params = (ctypes.c_void_p * max(1, n))(*range(base, base + 8 * n, 8))
    g, b = _dims(grid), _dims(block)
    s = cupy.cuda.get_current_stream().ptr if stream is None else stream
    cfg = LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], smem, s,
                       ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), nattrs)
    err = lib.cuLaunchKernelEx(ctypes.byref(cfg), func_ptr, params, None)
    if err != 0:
        raise _launch_error(err, name)


# ----------------------------------------------------------------------------------------------------------------
# Device facts and workspaces
# ----------------------------------------------------------------------------------------------------------------
_sm_counts: dict = {}


def sm_count(dev: int) -> int:
    """Multiprocessors of CUDA device ``dev`` (asked once per device)."""
    n = _sm_counts.get(dev)
    if n is None:
        import cupy

        n = _sm_counts[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return n


def is_capturing() -> bool:
    """Whether the current CuPy stream is capturing a CUDA graph."""
    import cupy

    return bool(cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr))


_workspaces: dict = {}      # (device, stream, what) -> buffers, the last the largest
_ws_lock = threading.Lock()
_scope = threading.local()  # .workspaces: a capture scope's own dict (capture_scope), else unset


class capture_scope:
    """Inside this context (one thread), the workspaces that prepared calls bind come from ``store`` (a dict the
    caller keeps alive with its CUDA graph) instead of the process-wide per-stream ones, and plans are not cached:
    a captured graph then shares no scratch memory with eager calls or other graphs."""

    def __init__(self, store: dict):
        self.store = store

    def __enter__(self):
        self._prev = getattr(_scope, "workspaces", None)
        _scope.workspaces = self.store
        return self

    def __exit__(self, *exc):
        _scope.workspaces = self._prev
        return False


def in_capture_scope() -> bool:
    return getattr(_scope, "workspaces", None) is not None


def workspace(nfloats: int, device_id: int, stream: int, what: str = "partials"):
    """An fp32-sized scratch buffer of at least ``nfloats`` per (device, stream, ``what``: "partials" for split-K,
    "x_tiles" for the wgmma GEMM's tiled x), never freed: a CUDA graph captured around a call keeps pointing at
    valid memory, and growing it keeps the old buffer alive for the plans and graphs that hold it."""
    import cupy

    store = getattr(_scope, "workspaces", None)
    if store is None:
        store = _workspaces
    key = (device_id, stream, what)
    with _ws_lock:
        bufs = store.setdefault(key, [])
        if not bufs or bufs[-1].size < nfloats:
            with cupy.cuda.Device(device_id):
                bufs.append(cupy.empty(max(nfloats, 1 << 16), dtype=cupy.float32))
        return bufs[-1]


# ----------------------------------------------------------------------------------------------------------------
# Prepared calls
# ----------------------------------------------------------------------------------------------------------------
class PreparedCall:
    """The launches of one matmul call shape, bound to one weight, stream and workspace. ``run(x, y, bias=0)``
    (device pointers) patches each launch's x, output and bias slots and fires them in order. ``path`` says which
    kernels; a ``Path.CUBLAS`` call has no launches (``ops`` runs dequantize + cuBLAS itself). ``capture_safe``:
    nothing in it loads a module, allocates or calls cuBLAS, so it may run while the stream captures a graph."""

    __slots__ = ("path", "plan", "launches", "_x", "_y", "_b", "capture_safe", "_lock", "run")

    def __init__(self, path: Path, plan, launches=(), x_slots=(), y_slots=(), b_slots=()):
        self.path, self.plan, self.launches = path, plan, tuple(launches)
        # (slots array, index) pairs: which parameter of which launch takes x, the output and the bias
        self._x = tuple((self.launches[i].slots, j) for i, j in x_slots)
        self._y = tuple((self.launches[i].slots, j) for i, j in y_slots)
        self._b = tuple((self.launches[i].slots, j) for i, j in b_slots)
        self.capture_safe = path is not Path.CUBLAS
        self._lock = threading.Lock()   # patch-then-fire is one step for threads sharing a stream and weight
        # run(x, y, bias=0): the one-launch call (the GEMV, the mma.sync GEMM without a split) has its own
        # straight-line version: it is the decode loop's whole host cost after the checks
        if len(self.launches) == 1 and len(self._x) == len(self._y) == len(self._b) == 1:
            self.run = self._one(self.launches[0], self._x[0][1], self._y[0][1], self._b[0][1], self._lock)
        else:
            self.run = self._many

    @staticmethod
    def _one(launch: "Launch", xi: int, yi: int, bi: int, lock):
        s = launch.slots
        fire = launch.fire

        def run(x: int, y: int, bias: int = 0) -> None:
            with lock:
                s[xi] = x
                s[yi] = y
                if bias:
                    s[bi] = bias
                fire()

        return run

    def _many(self, x: int, y: int, bias: int = 0) -> None:
        with self._lock:
            for s, i in self._x:
                s[i] = x
            for s, i in self._y:
                s[i] = y
            if bias:
                for s, i in self._b:
                    s[i] = bias
            for launch in self.launches:
                launch.fire()

    def __repr__(self) -> str:
        return f"PreparedCall({self.path.name}, {self.plan!r}, launches={list(self.launches)})"


_gemv_shape_kernels: dict = {}   # (variant, shape arguments, warps, tokens or None, device) -> loaded Kernel


def gemv_kernel(w, plan: GemvPlan, kind: str, arch, M: int | None = None, specialize: bool | None = None,
                shape: tuple | None = None, capturing: bool | None = None):
    """The GEMV kernel for ``plan`` of weight ``w``: compiled for its launch shape (``shape``, by default
    plans.gemv_shape_args(w, plan)) where ``plans.gemv_specializes`` (or ``specialize``) says so, and for the token
    count M too where plans.gemv_compiled_tokens says so; else the generic variant. While the current stream
    captures a CUDA graph (``capturing``; asked when None), a launch shape not compiled and loaded yet takes the
    generic variant (bitwise the same result): loading a module would invalidate the capture. Building a shape's
    kernel outside a capture therefore loads the generic variant too."""
    from .kernels import gemv_shape_family, get_kernel, kernel

    v = plan.variant(kind)
    if plans.gemv_specializes(arch, w.K, w.N) if specialize is None else specialize:
        if shape is None:
            shape = plans.gemv_shape_args(w, plan)
        tokens = plans.gemv_compiled_tokens(M, w.K, w.N)
        key = (v, shape, plan.warps, tokens, w.device)   # what the kernel is compiled for
        k = _gemv_shape_kernels.get(key)
        if k is not None:
            return k
        if not (is_capturing() if capturing is None else capturing):
            kernel("gemv_tc", v, w.device)   # the fallback of a later capture, loaded now
            fam = gemv_shape_family(v, shape, plan.warps, tokens=tokens)
            k = _gemv_shape_kernels[key] = get_kernel(fam, v, w.device)
            return k
    return kernel("gemv_tc", v, w.device)


def gemv_args(x2, w, bias_arg, y2, M: int, plan: GemvPlan, shape: tuple | None = None) -> tuple:
    """awq_gemv_tc_kernel's argument list for ``plan`` (also used by bench/gemv_trace.py); ``shape``:
    plans.gemv_shape_args(w, plan), if the caller has it already."""
    return (x2, w.qtiles, w.scales, w.zeros, bias_arg, y2, as_i32(M)) + (
        plans.gemv_shape_args(w, plan) if shape is None else shape)


def prepare_gemv(w, M: int, kind: str, arch, sms: int, stream: int, *, capturing: bool = False,
                 plan: GemvPlan | None = None) -> PreparedCall:
    """The GEMV call for M rows of ``w`` on ``stream`` (``plan``: plans.plan_gemv's by default)."""
    if plan is None:
        plan = plans.plan_gemv(M, w.K, w.N, w.group_size, arch=arch, sm_count=sms, dtype=kind)
    shape = plans.gemv_shape_args(w, plan)
    k = gemv_kernel(w, plan, kind, arch, M, shape=shape, capturing=capturing)
    launch = Launch(k, (plan.grid,), (32 * plan.warps,), gemv_args(NULL, w, NULL, NULL, M, plan, shape),
                    smem=plan.smem, pdl=plans.uses_pdl(arch), stream=stream)
    return PreparedCall(Path.GEMV, plan, (launch,), x_slots=((0, 0),), y_slots=((0, 5),), b_slots=((0, 4),))


def _resident(device: int):
    from .kernels import GEMM_WARPS, kernel

    def resident(variant: str, smem: int) -> int:
        family = "gemm_wg" if variant.startswith("awq_gemm_wg") else "gemm_tc"
        return kernel(family, variant, device).resident_blocks(32 * GEMM_WARPS, smem)

    return resident


def prepare_gemm(w, M: int, kind: str, arch, sms: int, stream: int, *, batch_invariant: bool = False,
                 plan: GemmPlan | None = None, **force) -> PreparedCall:
    """The fused GEMM call for M rows of ``w`` on ``stream``: plans.plan_gemm_launch's plan (``force``: its
    forcing arguments, for tuning and probes), the wgmma kernel's x-tile pass before it and the split-K reduce
    after it where the plan has them, with their workspaces."""
    from .kernels import GEMM_WARPS, kernel, reduce_variant, tile_x_variant

    if plan is None:
        plan = plans.plan_gemm_launch(M, w.K, w.N, w.group_size, kind, arch, sms, _resident(w.device),
                                      batch_invariant=batch_invariant, **force)
    pdl = plans.uses_pdl(arch)
    dev = w.device
    Np = w.NT * 64
    ws = workspace(plan.splits * M * Np, dev, stream) if plan.splits > 1 else NULL
    launches = []
    x_slots = ((0, 0),)
    xin = NULL
    if plan.wgmma:   # x as per-(token tile, 64-k unit) shared-memory images, each brought in by one bulk copy
        BM = 8 * plan.token_blocks
        chunks = plans.x_tile_chunks(M, w.K, BM)
        xin = workspace(chunks * 4, dev, stream, "x_tiles")
        launches.append(Launch(kernel("gemm_wg", tile_x_variant(kind), dev), (min(-(-chunks // 256), 1 << 16),),
                               (256,), (NULL, xin, as_i32(M), as_i32(w.K), as_i32(w.KS), as_i32(BM),
                                        np.int64(chunks), plans.fastdiv(w.KS)), pdl=pdl, stream=stream))
    gk = kernel("gemm_wg" if plan.wgmma else "gemm_tc", plan.variant(kind), dev)
    g = len(launches)
    launches.append(Launch(gk, plan.grid, (32 * GEMM_WARPS,),
                           (xin, w.qtiles, w.scales, w.zeros, NULL, NULL, ws, as_i32(M), as_i32(w.N), as_i32(w.K),
                            as_i32(plan.NT16), as_i32(w.KS), as_i32(w.group_size), as_i32(w.NG), as_i32(Np),
                            as_i32(plan.per)), smem=plan.smem, pdl=pdl, stream=stream))
    if not plan.wgmma:
        x_slots = ((g, 0),)
    y_slots, b_slots = [(g, 5)], [(g, 4)]
    if plan.splits > 1:
        cols = plan.reduce_cols
        items = M * w.N // cols
        r = len(launches)
        launches.append(Launch(kernel("gemm_tc", reduce_variant(kind, cols), dev), (min(-(-items // 256), 4096),),
                               (256,), (ws, NULL, NULL, as_i32(M), as_i32(w.N), as_i32(Np), as_i32(plan.splits)),
                               pdl=pdl, stream=stream))
        y_slots.append((r, 2))
        b_slots.append((r, 1))
    return PreparedCall(Path.GEMM, plan, launches, x_slots=x_slots, y_slots=y_slots, b_slots=b_slots)


def prepare_call(w, M: int, kind: str, stream: int, *, batch_invariant: bool = False,
                 capturing: bool = False) -> PreparedCall:
    """matmul's call for M rows of ``w`` on ``stream``: the path plans.choose_path picks, prepared."""
    from .jit import arch_of_device

    arch = arch_of_device(w.device)
    sms = sm_count(w.device)
    path = plans.choose_path(M, w.K, w.N, w.group_size, kind, arch, sms, batch_invariant=batch_invariant,
                             capturing=capturing)
    if path is Path.GEMV:
        return prepare_gemv(w, M, kind, arch, sms, stream, capturing=capturing)
    if path is Path.CUBLAS:
        return PreparedCall(Path.CUBLAS, None)
    return prepare_gemm(w, M, kind, arch, sms, stream, batch_invariant=batch_invariant)


def _ptr(a) -> int:
    return 0 if a is None or isinstance(a, np.generic) else a.data.ptr


def run_gemv(x2, w, bias_arg, y2, M, kind, sms, tiles=None, warps=None, kdepth=None) -> None:
    """One GEMV launch for a plan with forced choices (``plans.plan_gemv``'s ``tiles``, ``warps``, ``kdepth``):
    for ``tune``, the benchmark's per-path contenders and probes. Prepares afresh on every call."""
    import cupy

    from .jit import arch_of_device

    arch = arch_of_device(w.device)
    plan = plans.plan_gemv(M, w.K, w.N, w.group_size, arch=arch, sm_count=sms, tiles=tiles, warps=warps,
                           dtype=kind, kdepth=kdepth)
    pc = prepare_gemv(w, M, kind, arch, sms, cupy.cuda.get_current_stream().ptr, plan=plan)
    pc.run(_ptr(x2), _ptr(y2), _ptr(bias_arg))


def run_gemm(x2, w, bias_arg, y2, M, kind, arch, sms, batch_invariant, **force) -> None:
    """One fused GEMM call with forced choices (plans.plan_gemm_launch's ``tiles``, ``splits``, ``wgmma``,
    ``depth``, ``pend``, ``reduce_cols``, ``ksplit``): for ``tune``, the benchmark's per-path contenders and probes.
    Prepares afresh on every call."""
    import cupy

    pc = prepare_gemm(w, M, kind, arch, sms, cupy.cuda.get_current_stream().ptr, batch_invariant=batch_invariant,
                      **force)
    pc.run(_ptr(x2), _ptr(y2), _ptr(bias_arg))
