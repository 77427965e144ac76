"""``python -m awq_cupy bench --decode``: one decode step's linear layers, eager and as a CUDA graph, against cuBLAS
fp16, and the host time of one call next to the launch floor, all in one process.

The step: every layer's four linears (qkv, o, gate_up, down) in order, each with its own weight (distinct device
memory per layer, as in a model), M = 1 and 16 rows, outputs preallocated (``out=``).

* Eager: a plain Python loop of ``matmul(x, w, out=y)`` calls, synchronised at the end; the time is the wall time
  of the step (host and GPU together, as a user's loop sees it), median over trials.
* Graph: the same step captured once with ``awq_cupy.capture`` and replayed; CUDA-event time per replay.
* cuBLAS fp16: the same step with dense fp16 weights. Eager through ``cupy.matmul``; as a graph through cuBLAS
  called directly (ctypes ``cublasGemmEx`` on a handle of our own: CuPy refuses to capture its cuBLAS calls).
  The fp16 weights of a whole model may not fit beside the int4 ones (Llama-2-70B: 137 GB): the fp16 side then
  holds as many distinct layers as fit and the step cycles over them, every layer-call still a different layer
  than the one before and each far larger than L2, so every call reads its weights from HBM. The table says how
  many distinct fp16 layers there were.
* Host us per call: the host time of one call enqueued while the GPU is busy (a spin kernel preloads its queue, so
  no call waits for the GPU): awq_cupy ``matmul`` with and without ``out=``, the bound call (``awq_cupy.bind``),
  ``cupy.matmul`` fp16, a CuPy RawKernel launch with 18 arguments, and ``cuLaunchKernelEx`` through ctypes with a
  prebuilt parameter array and the PDL attribute (``launch.Launch.fire``: the floor), also with two pointers
  patched.
"""
from __future__ import annotations

import ctypes
import sys
import time

import numpy as np

DECODE_LAYERS = {"mistral-7b": 32, "llama-2-70b": 80}
DECODE_M = (1, 16)

_PROBE_SRC = r'''
extern "C" __global__ void awq_host_probe(const void* a, const void* b, const void* c, const void* d,
                                          const void* e, void* f, int m, int n, int k, int p, int q, int r, int s,
                                          int t, int u, int v, int w, int x) {}
'''


# ----------------------------------------------------------------------------------------------------------------
# cuBLAS fp16 through ctypes (capturable: our own handle, stream and workspace)
# ----------------------------------------------------------------------------------------------------------------
class _Cublas:
    CUDA_R_16F, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 2, 68, -1

    def __init__(self):
        import cupy

        lib = None
        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError("libcublas not found for the cuBLAS graph baseline")
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.ws = cupy.empty(32 << 20, cupy.uint8)
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.ws.data.ptr),
                                              ctypes.c_size_t(self.ws.nbytes)), "cublasSetWorkspace")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._stream = None

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed: cublasStatus {status}")

    def gemm(self, x, W, y):
        """y[M, N] = x[M, K] @ W[K, N], row-major fp16, fp32 accumulation, on the current stream."""
        import cupy

        s = cupy.cuda.get_current_stream().ptr
        if s != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(s)), "cublasSetStream")
            self._stream = s
        M, K = x.shape
        N = W.shape[1]
        self._check(self.lib.cublasGemmEx(
            self.handle, 0, 0, N, M, K, ctypes.byref(self.alpha), ctypes.c_void_p(W.data.ptr), self.CUDA_R_16F, N,
            ctypes.c_void_p(x.data.ptr), self.CUDA_R_16F, K, ctypes.byref(self.beta), ctypes.c_void_p(y.data.ptr),
            self.CUDA_R_16F, N, self.CUBLAS_COMPUTE_32F, self.CUBLAS_GEMM_DEFAULT), "cublasGemmEx")

    def close(self):
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def _median(v):
    return float(np.median(v))


def eager_ms(step, trials: int) -> float:
    """Wall time of ``step()`` from an idle GPU to its completion, median of ``trials`` (ms)."""
    import cupy

    s = cupy.cuda.get_current_stream()
    step()
    s.synchronize()
    out = []
    for _ in range(trials):
        s.synchronize()
        t0 = time.perf_counter()
        step()
        s.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return _median(out)


def graph_ms(replay, trials: int, reps: int = 5) -> float:
    """CUDA-event time of one replay (``reps`` back to back per trial), median of ``trials`` (ms)."""
    import cupy

    s = cupy.cuda.get_current_stream()
    replay()
    s.synchronize()
    out = []
    for _ in range(trials):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        for _ in range(reps):
            replay()
        e1.record()
        e1.synchronize()
        out.append(cupy.cuda.get_elapsed_time(e0, e1) / reps)
    return _median(out)


def host_us(fns: dict, n: int = 200, rounds: int = 9) -> dict:
    """Host time of one call (us) of each of ``fns`` ({name: callable}) while the GPU is kept busy by a spin
    kernel, so that no call waits for the GPU: ``rounds`` rounds, each timing ``n`` calls of every callable in
    turn (the host's noise then falls on all of them alike); per callable the median over rounds of the mean per
    call."""
    import cupy

    from .kernels import SPIN_KERNEL, kernel

    spin = kernel(SPIN_KERNEL)
    s = cupy.cuda.get_current_stream()
    for fn in fns.values():
        for _ in range(3):
            fn()
    s.synchronize()
    out = {k: [] for k in fns}
    spin_ns = 20_000_000
    while min(len(v) for v in out.values()) < rounds:
        for name, fn in fns.items():
            while True:
                spin.launch((1,), (1,), (np.int64(spin_ns),))
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                t = time.perf_counter() - t0
                s.synchronize()
                if t * 1e9 < 0.8 * spin_ns:
                    break
                spin_ns *= 2     # the GPU may have drained its queue and calls waited for it: longer spin, again
            out[name].append(t / n * 1e6)
    return {k: _median(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------------
# the runs
# ----------------------------------------------------------------------------------------------------------------
def _int4_layers(rng, shapes, layers: int, dtype: str = "float16"):
    """``layers`` distinct copies of a random int4 layer per shape (group 128): [{name: QuantizedWeight}]."""
    import awq_cupy
    from awq_cupy import formats

    out = [{} for _ in range(layers)]
    for name, K, N in shapes:
        t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // 128, N), np.uint8),
                         rng.uniform(0.001, 0.01, (K // 128, N)).astype(np.float16), "gemm", 128)
        w0 = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], 128, dtype=dtype)
        for i in range(layers):
            out[i][name] = w0 if i == 0 else awq_cupy.QuantizedWeight(
                qtiles=w0.qtiles.copy(), scales=w0.scales.copy(), zeros=w0.zeros.copy(), K=K, N=N, group_size=128,
                dtype=dtype)
    return out


def run_model(model: str, shapes, ms=DECODE_M, trials: int = 5, progress=True) -> list[dict]:
    """The decode step of ``model`` (``DECODE_LAYERS`` layers of the linears ``shapes``: [(name, K, N)])."""
    import cupy

    import awq_cupy

    L = DECODE_LAYERS[model]
    rng = np.random.default_rng(0)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    say(f"[decode] {model}: {L} layers x {len(shapes)} linears, int4 weights")
    wl = _int4_layers(rng, shapes, L)
    rows = []
    for M in ms:
        xs = {n: cupy.asarray(rng.standard_normal((M, K)).astype(np.float16)) for n, K, N in shapes}
        ys = {n: cupy.empty((M, N), cupy.float16) for n, K, N in shapes}

        def step():
            for layer in wl:
                for n, _, _ in shapes:
                    awq_cupy.matmul(xs[n], layer[n], out=ys[n])
            return ys

        e = eager_ms(step, trials)
        g = awq_cupy.capture(step)
        gr = graph_ms(g, trials)
        # replayed outputs: bitwise the eager ones
        step()
        eager_out = {n: y.copy() for n, y in ys.items()}
        g()
        cupy.cuda.get_current_stream().synchronize()
        same = all(bool((eager_out[n].view(cupy.uint16) == ys[n].view(cupy.uint16)).all()) for n in ys)
        if not same:
            raise RuntimeError(f"{model} M={M}: the replayed decode step differs from the eager one")
        rows.append(dict(model=model, M=M, layers=L, awq_eager_ms=e, awq_graph_ms=gr))
        say(f"[decode] {model} M={M}: awq_cupy eager {e:.3f} ms, graph {gr:.3f} ms")
        del g
    # fp16: as many distinct layers as fit next to nothing else (the int4 copies are freed first)
    dense0 = {n: awq_cupy.dequantize(wl[0][n]) for n, _, _ in shapes}
    wl = None
    cupy.get_default_memory_pool().free_all_blocks()
    per_layer = sum(d.nbytes for d in dense0.values())
    free = cupy.cuda.runtime.memGetInfo()[0]
    L16 = max(2, min(L, int(0.85 * free // per_layer)))
    say(f"[decode] {model}: fp16 weights for {L16} distinct layers ({per_layer * L16 / 2**30:.1f} GiB)")
    dense = [dense0] + [{n: d.copy() for n, d in dense0.items()} for _ in range(L16 - 1)]
    blas = _Cublas()
    try:
        for row in rows:
            M = row["M"]
            xs = {n: cupy.asarray(rng.standard_normal((M, K)).astype(np.float16)) for n, K, N in shapes}
            ys = {n: cupy.empty((M, N), cupy.float16) for n, K, N in shapes}
            ref = cupy.matmul(xs["qkv"], dense[0]["qkv"])
            blas.gemm(xs["qkv"], dense[0]["qkv"], ys["qkv"])
            err = float(cupy.abs(ys["qkv"].astype(cupy.float32) - ref.astype(cupy.float32)).max())
            if not err <= 1e-2 * (float(cupy.abs(ref).max()) + 1e-6):
                raise RuntimeError(f"cuBLAS through ctypes disagrees with cupy.matmul (max abs err {err})")

            def step16():
                for i in range(L):
                    d = dense[i % L16]
                    for n, _, _ in shapes:
                        cupy.matmul(xs[n], d[n], out=ys[n])
                return ys

            def step16_direct():
                for i in range(L):
                    d = dense[i % L16]
                    for n, _, _ in shapes:
                        blas.gemm(xs[n], d[n], ys[n])
                return ys

            row["fp16_layers"] = L16
            row["cublas_eager_ms"] = eager_ms(step16, trials)
            g16 = awq_cupy.capture(step16_direct)
            row["cublas_graph_ms"] = graph_ms(g16, trials)
            del g16
            say(f"[decode] {model} M={M}: cuBLAS fp16 eager {row['cublas_eager_ms']:.3f} ms, graph "
                f"{row['cublas_graph_ms']:.3f} ms")
    finally:
        blas.close()
    dense = dense0 = None
    cupy.get_default_memory_pool().free_all_blocks()
    for row in rows:
        row["eager_over_graph"] = row["awq_eager_ms"] / row["awq_graph_ms"]
        row["speedup_vs_cublas_eager"] = row["cublas_eager_ms"] / row["awq_eager_ms"]
        row["graph_speedup_vs_cublas_graph"] = row["cublas_graph_ms"] / row["awq_graph_ms"]
    return rows


def run_host(ms=DECODE_M, K: int = 4096, N: int = 6144) -> list[dict]:
    """Host us per call on one Mistral-7B qkv-sized layer (see the module docstring)."""
    import cupy

    import awq_cupy

    from . import jit, launch

    rng = np.random.default_rng(1)
    w = _int4_layers(rng, [("qkv", K, N)], 1)[0]["qkv"]
    dense = awq_cupy.dequantize(w)
    probe = cupy.RawKernel(_PROBE_SRC, "awq_host_probe")
    sink = cupy.zeros(1024, cupy.uint32)
    args18 = (sink, sink, sink, sink, sink, sink) + tuple(np.int32(i) for i in range(12))
    probe((1,), (32,), args18)     # compiles and loads it
    # the floor: the same empty 18-argument kernel, launched from a prebuilt parameter array with the PDL attribute
    fn = jit.Kernel("awq_host_probe", "host_probe", cupy.cuda.runtime.getDevice(), probe.kernel, None)
    floor = launch.Launch(fn, (1,), (32,), args18, pdl=True, stream=cupy.cuda.get_current_stream().ptr)
    rows = []
    for M in ms:
        x = cupy.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cupy.empty((M, N), cupy.float16)
        bound = awq_cupy.bind(w, M)
        slots = floor.slots
        p0, p1 = sink.data.ptr, sink.data.ptr + 64

        def patched():     # two pointer slots written per call, as matmul's prepared calls do
            slots[0] = p0
            slots[5] = p1
            floor.fire()

        r = dict(M=M, K=K, N=N)
        awq_cupy.matmul(x, w, out=y)
        pc = w._calls[(M, cupy.cuda.get_current_stream().ptr, False, False)]   # what matmul_out launches
        r.update(host_us({
            "matmul_out": lambda: awq_cupy.matmul(x, w, out=y),
            "matmul_alloc": lambda: awq_cupy.matmul(x, w),
            "bound_out": lambda: bound(x, out=y),
            "cupy_matmul_fp16": lambda: cupy.matmul(x, dense, out=y),
            "cupy_rawkernel_18_args": lambda: probe((1,), (32,), args18),
            "prepared_fire": pc.launches[0].fire,                       # matmul's own launch alone, no checks
            "cuLaunchKernelEx_prebuilt": floor.fire,
            "cuLaunchKernelEx_patched": patched,
        }))
        rows.append(r)
    return rows


def print_decode(rows, host_rows, file=sys.stdout) -> None:
    print("\n# one decode step's linear layers (ms; eager = Python loop, wall time; graph = CUDA-graph replay)",
          file=file)
    print(f"{'model':12s} {'M':>3s} {'layers':>6s} {'awq eager':>10s} {'awq graph':>10s} {'eager/graph':>11s} "
          f"{'cuBLAS eager':>12s} {'cuBLAS graph':>12s} {'fp16 layers':>11s} {'vs cuBLAS eager':>15s} "
          f"{'graph vs graph':>14s}", file=file)
    for r in rows:
        print(f"{r['model']:12s} {r['M']:3d} {r['layers']:6d} {r['awq_eager_ms']:10.3f} {r['awq_graph_ms']:10.3f} "
              f"{r['eager_over_graph']:10.2f}x {r['cublas_eager_ms']:12.3f} {r['cublas_graph_ms']:12.3f} "
              f"{r['fp16_layers']:11d} {r['speedup_vs_cublas_eager']:14.2f}x "
              f"{r['graph_speedup_vs_cublas_graph']:13.2f}x", file=file)
    if host_rows:
        keys = [k for k in host_rows[0] if k not in ("M", "K", "N")]
        print(f"\n# host us per call ({host_rows[0]['K']}x{host_rows[0]['N']} layer; GPU kept busy)", file=file)
        print(f"{'M':>3s} " + " ".join(f"{k:>26s}" for k in keys), file=file)
        for r in host_rows:
            print(f"{r['M']:3d} " + " ".join(f"{r[k]:26.2f}" for k in keys), file=file)
        for r in host_rows:
            print(f"M={r['M']}: matmul(x, w, out=y) {r['matmul_out']:.2f} us = "
                  f"{r['matmul_out'] / r['cuLaunchKernelEx_prebuilt']:.2f}x the prebuilt cuLaunchKernelEx "
                  f"(target <= 2x); without out= {r['matmul_alloc'] - r['matmul_out']:+.2f} us (target <= +5); "
                  f"cupy.matmul {r['cupy_matmul_fp16'] / r['matmul_out']:.1f}x awq_cupy's", file=file)
