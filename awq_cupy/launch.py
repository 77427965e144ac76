"""The launch layer: plans (``plans``) turned into prepared kernel launches that a call only has to fire.

A ``driver.Launch`` holds everything of one kernel launch but the pointers that change from call to call. A
``PreparedCall`` is the launches of one matmul call shape (the GEMV; the GEMM with its x-tile pass and split-K
reduce) with their workspaces bound, and the positions of the x / output / bias parameters it patches per call.

Workspaces (split-K partials, the wgmma GEMM's x tiles) are per (device, stream) and never freed, so that a CUDA
graph captured around a call keeps pointing at live memory; ``capture_scope`` gives a captured step workspaces
of its own.
"""
from __future__ import annotations

import threading

import numpy as np

from . import plans
from .driver import Launch, TensorMap
from .jit import as_i32
from .plans import GemmPlan, GemvPlan, Path, RowSplit

__all__ = ["PreparedCall", "prepare_call", "prepare_gemv", "prepare_gemm", "run_gemv", "run_gemm", "workspace",
           "capture_scope", "is_capturing", "sm_count", "NULL", "Launch"]

NULL = np.uint64(0)      # a null pointer argument (also the placeholder of the slots patched per call)


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

    __slots__ = ("path", "plan", "launches", "_spec", "_x", "_y", "_b", "_xo", "_yo", "_xm", "capture_safe", "_lock",
                 "run")

    def __init__(self, path: Path, plan, launches=(), x_slots=(), y_slots=(), b_slots=()):
        self.path, self.plan, self.launches = path, plan, tuple(launches)
        # (launch, parameter, byte offset) of x, the output and the bias; given as (launch, parameter) pairs, the
        # offset is 0 (a row split's second call has its rows' offset)
        self._spec = tuple(tuple((t[0], t[1], t[2] if len(t) > 2 else 0) for t in sl)
                           for sl in (x_slots, y_slots, b_slots))
        # what run patches: (the launch's slots array, parameter) of the slots written as given, and (slots,
        # parameter, offset) of those written at an offset
        # x given to a tensor-map parameter: (map, offset), encoded for x + offset
        maps = [one.maps for one in self.launches]
        self._xm = tuple((maps[i][j], o) for i, j, o in self._spec[0] if j in maps[i])
        x_spec = tuple(t for t in self._spec[0] if t[1] not in maps[t[0]])
        self._x, self._y, self._b = (tuple((self.launches[i].slots, j) for i, j, o in sl if not o)
                                     for sl in (x_spec,) + self._spec[1:])
        self._xo, self._yo = (tuple((self.launches[i].slots, j, o) for i, j, o in sl if o)
                              for sl in (x_spec, self._spec[1]))
        if any(o for _, _, o in self._spec[2]):
            raise ValueError("the bias is never offset: every part of a call adds the same bias")
        self.capture_safe = path is not Path.CUBLAS
        self._lock = threading.Lock()   # patch-then-fire is one step for threads sharing a stream and weight
        # run(x, y, bias=0): the one-launch call (the GEMV, the mma.sync GEMM without a split) has its own
        # straight-line version: it is the decode loop's whole host cost after the checks
        if (len(self.launches) == 1 and len(self._x) == len(self._y) == len(self._b) == 1
                and not self._xo + self._yo + self._xm):
            self.run = self._one(self.launches[0], self._x[0][1], self._y[0][1], self._b[0][1], self._lock)
        else:
            self.run = self._many

    @classmethod
    def row_split(cls, first: "PreparedCall", second: "PreparedCall", rows: int, K: int, N: int,
                  itemsize: int) -> "PreparedCall":
        """One call of two prepared calls on row slices: ``first`` for rows 0..rows-1, ``second`` for the rest
        (its x and output pointers offset by ``rows`` rows of K and of N elements of ``itemsize`` bytes)."""
        n = len(first.launches)
        spec = [a + tuple((i + n, j, o + off) for i, j, o in b)
                for a, b, off in zip(first._spec, second._spec, (rows * K * itemsize, rows * N * itemsize, 0))]
        return cls(first.path, RowSplit(rows, first.plan, second.plan), first.launches + second.launches, *spec)

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
            for m, o in self._xm:
                m.point(x + o if o else x)
            for s, i in self._x:
                s[i] = x
            for s, i in self._y:
                s[i] = y
            for s, i, o in self._xo:
                s[i] = x + o
            for s, i, o in self._yo:
                s[i] = y + o
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
            kernel(v, w.device)   # the fallback of a later capture, loaded now
            fam = gemv_shape_family(v, shape, plan.warps, tokens=tokens)
            k = _gemv_shape_kernels[key] = get_kernel(fam, v, w.device)
            return k
    return kernel(v, w.device)


def gemv_args(x2, w, bias_arg, y2, M: int, plan: GemvPlan, shape: tuple | None = None) -> tuple:
    """awq_gemv_tc_kernel's argument list for ``plan`` (also used by bench/probes/gemv_trace.py); ``shape``:
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
    from .kernels import kernel

    def resident(variant, smem: int) -> int:
        return kernel(variant, device).resident_blocks(variant.threads, smem)

    return resident


def prepare_gemm(w, M: int, kind: str, arch, sms: int, stream: int, *, batch_invariant: bool = False,
                 plan: GemmPlan | None = None, **force) -> PreparedCall:
    """The fused GEMM call for M rows of ``w`` on ``stream``: plans.plan_gemm_launch's plan (``force``: its
    forcing arguments, for tuning and probes), the wgmma kernel's x-tile pass before it (for the variants that
    neither copy x themselves nor read it through a tensor map) and the split-K reduce after it where the plan has
    them, with their workspaces."""
    from .kernels import ReduceVariant, TileXVariant, kernel

    if plan is None:
        plan = plans.plan_gemm_launch(M, w.K, w.N, w.group_size, kind, arch, sms, _resident(w.device),
                                      batch_invariant=batch_invariant, **force)
    pdl = plans.uses_pdl(arch)
    dev = w.device
    Np = w.NT * 64
    ws = workspace(plan.splits * M * Np, dev, stream) if plan.splits > 1 else NULL
    variant = plan.variant(kind)
    launches = []   # x goes to the x-tile pass, or to the GEMM launches themselves
    xin = NULL
    x_slots = []
    tile_pass = plan.wgmma and not plan.producers and not plan.tma
    # one tensor map of x [M, K] for every GEMM launch of the call, encoded for x at each run
    xmap = TensorMap(M, w.K, 8 * plan.token_blocks, 64) if plan.tma else None
    if tile_pass:   # x as per-(token tile, 64-k unit) shared-memory images, each brought in by one bulk copy
        BM = 8 * plan.token_blocks
        chunks = plans.x_tile_chunks(M, w.K, BM)
        xin = workspace(chunks * 4, dev, stream, "x_tiles")
        launches.append(Launch(kernel(TileXVariant(kind), dev), (min(-(-chunks // 256), 1 << 16),),
                               (256,), (NULL, xin, as_i32(M), as_i32(w.K), as_i32(w.KS), as_i32(BM),
                                        np.int64(chunks), plans.fastdiv(w.KS)), pdl=pdl, stream=stream))
        x_slots.append((0, 0))
    gk = kernel(variant, dev)

    def gemm(grid, per, ws, blk_base, ws_ld):
        args = ((xin, w.qtiles, w.scales, w.zeros, NULL, NULL, ws, as_i32(M), as_i32(w.N), as_i32(w.K),
                 as_i32(plan.NT16), as_i32(w.KS), as_i32(w.group_size), as_i32(w.NG), as_i32(Np), as_i32(per),
                 as_i32(blk_base), as_i32(ws_ld)) + ((xmap,) if xmap is not None else ()))
        if not tile_pass:   # x itself (producers), or the tensor map last
            x_slots.append((len(launches), len(args) - 1 if xmap is not None else 0))
        launches.append(Launch(gk, grid, (variant.threads,), args, smem=plan.smem, pdl=pdl, stream=stream))

    y_slots, b_slots = [(len(launches), 5)], [(len(launches), 4)]
    gemm(plan.grid, plan.per, ws, 0, Np)
    splits, n0 = plan.splits, 0
    if plan.tail is not None:   # the last column tiles, split, into a workspace of their own columns
        if not plan.wgmma:
            raise ValueError("a tail launch is planned for the wgmma GEMM only (both launches read one x image)")
        splits, n0 = plan.tail.splits, 16 * plan.tail_block0
        ws_ld = Np - n0
        ws = workspace(splits * M * ws_ld, dev, stream)
        gemm(plan.tail_grid, plan.tail.per, ws, plan.tail_block0, ws_ld)
    if splits > 1:
        cols = plan.reduce_cols
        items = M * (w.N - n0) // cols
        r = len(launches)
        launches.append(Launch(kernel(ReduceVariant(kind, cols), dev), (min(-(-items // 256), 4096),),
                               (256,), (ws, NULL, NULL, as_i32(M), as_i32(w.N), as_i32(Np - n0), as_i32(splits),
                                        as_i32(n0)),
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
    if not batch_invariant:
        rows = plans.row_split(M, w.K, w.N, w.group_size, kind, arch, sms, _resident(w.device))
        if rows:   # whole 256-token tiles, then the remaining rows as a call of their own
            parts = [prepare_call(w, m, kind, stream, capturing=capturing) for m in (rows, M - rows)]
            if all(p.capture_safe for p in parts):
                return PreparedCall.row_split(*parts, rows, w.K, w.N, 2)
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
    ``depth``, ``pend``, ``reduce_cols``, ``ksplit``, ``tail``, ``token_tile``, ``producers``): for ``tune``, the
    benchmark's per-path contenders and probes. Prepares afresh on every call."""
    import cupy

    pc = prepare_gemm(w, M, kind, arch, sms, cupy.cuda.get_current_stream().ptr, batch_invariant=batch_invariant,
                      **force)
    pc.run(_ptr(x2), _ptr(y2), _ptr(bias_arg))
