"""``python -m awq_cupy bench``: awq_cupy against cuBLAS fp16 on real model layer shapes.

Method (docs/benchmarking.md §Timing one call), the same for every contender:
* L2 is defeated by rotating over enough weight copies (>= ``--rotate-mb`` MB per contender, default 512).
* Python launch gaps are kept out by preloading the GPU queue: a spin kernel busies the GPU while the host
  enqueues the start event, the timed calls and the end event, which then run back to back. A trial whose host
  enqueue outlasted the spin is repeated with a longer spin.
* Outputs are validated against a float32 cuBLAS product of the exact dequantized weight before timing.
* Each figure is the median over ``--trials`` trials of the mean time per call.
Bytes for TB/s follow docs/benchmarking.md §Bytes and ratios: int4 weights + fp16 scales + int4 zeros +
activations + outputs (fp16 weights for cuBLAS); ceilings: 4.5 TB/s measured HBM read, 790 TFLOP/s measured
cuBLAS fp16.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

HBM_TBPS = 4.5
PEAK_TFLOPS = 790.0

MODELS = {
    "mistral-7b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "llama-2-70b": [("qkv", 8192, 10240), ("o", 8192, 8192), ("gate_up", 8192, 57344), ("down", 28672, 8192)],
}
DEFAULT_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_M = [1, 16, 64, 256, 1024]
CONTENDERS = ("awq_cupy", "cublas_fp16", "dequant_cublas")
# awq_cupy's individual paths, whatever the dispatch table would pick (for `tune` and kernel work): the GEMV with
# its default plan (up to 16 rows; up to 32 on sm_90 with groups of whole 64-k blocks), or 1, 2, 3 or 4 16-column
# blocks per warp unit (M <= 16), the fused
# tensor-core GEMM as dispatched, and its mma.sync (gemm_sw) and wgmma (gemm_wg, compute capability 9.0 only)
# kernels whatever the table says.
PATHS = ("gemv", "gemv1", "gemv2", "gemv3", "gemv4", "gemv2x2", "gemm", "gemm_sw", "gemm_wg")


@dataclass
class Row:
    model: str
    layer: str
    K: int
    N: int
    M: int
    contender: str
    us: float
    tbps: float
    tflops: float
    ratio_vs_cublas: float
    max_rel_err: float


def _nvidia_smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version,"
                              "power.limit", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        vals = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        return dict(zip(["name", "sm_clock", "sm_clock_max", "mem_clock", "driver", "power_limit"], vals))
    except Exception as e:  # nvidia-smi missing: the header says so
        return {"nvidia_smi": f"unavailable ({type(e).__name__})"}


def environment() -> dict:
    import cupy

    from . import __version__
    from .jit import nvrtc_version

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    return dict(gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                compute_capability=dev.compute_capability, sms=props["multiProcessorCount"],
                l2_mb=props["l2CacheSize"] / 2**20, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                cuda_driver=cupy.cuda.runtime.driverGetVersion(), cupy=cupy.__version__,
                nvrtc=".".join(map(str, nvrtc_version())), awq_cupy=__version__, numpy=np.__version__,
                python=platform.python_version(), smi=_nvidia_smi(),
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


class Timer:
    """Queue-preloaded timing of ``fn(i)`` calls (see module docstring)."""

    def __init__(self):
        import cupy

        from .kernels import SPIN_KERNEL, kernel

        self.cupy = cupy
        self.spin = kernel(SPIN_KERNEL)

    def __call__(self, fn, n_calls: int, trials: int) -> float:
        cp = self.cupy
        fn(0)                              # first call outside the sizing pass: it may compile kernels (seconds),
        cp.cuda.get_current_stream().synchronize()   # which would size the spin (and every trial) to minutes
        t0 = time.perf_counter()           # host cost of one enqueue pass, to size the spin
        for i in range(n_calls):
            fn(i)
        cp.cuda.get_current_stream().synchronize()
        host = time.perf_counter() - t0
        spin_s = 2.0 * host + 2e-3
        times = []
        attempts = 0
        while len(times) < trials:
            attempts += 1
            if attempts > 4 * trials:
                raise RuntimeError("could not preload the GPU queue (host enqueue keeps outlasting the spin)")
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            self.spin.launch((1,), (1,), (np.int64(int(spin_s * 1e9)),))
            h0 = time.perf_counter()
            e0.record()
            for i in range(n_calls):
                fn(i)
            e1.record()
            h = time.perf_counter() - h0
            e1.synchronize()
            if h > 0.8 * spin_s:           # the GPU may have drained the queue: not back to back, redo
                spin_s *= 2
                continue
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n_calls)
        return float(np.median(times))


def _ideal_bytes(K, N, M, G, fp16_weights: bool) -> float:
    w = K * N * 2 if fp16_weights else K * N / 2 + (K // G) * N * 2 + (K // G) * N / 2
    return w + M * K * 2 + M * N * 2


def random_gemm_tensors(rng, K, N, group_size=128) -> dict:
    """A random K x N layer as AutoAWQ ``gemm`` tensors (``qweight``, ``qzeros``, ``scales``, ``group_size``)."""
    from awq_cupy import formats

    G = formats.resolve_group_size(group_size, K)
    t = formats.pack(rng.integers(0, 16, (K, N), dtype=np.uint8), rng.integers(0, 16, (K // G, N), dtype=np.uint8),
                     rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16), "gemm", G)
    return dict(t, group_size=G)


def copies_for(nbytes: int, rotate_mb: int) -> int:
    """How many copies of a layer of ``nbytes`` make calls cycling through them read from HBM (at least two)."""
    return max(2, -(-rotate_mb * 2**20 // nbytes))


def rotated_weights(rng, K, N, group_size=128, dtype="float16", rotate_mb=512, tensors=None):
    """A random K x N layer (or the ``gemm`` ``tensors`` given, as ``random_gemm_tensors`` returns them) as
    ``QuantizedWeight``, repeated in as many independent copies as ``rotate_mb`` MB take (at least two): calls
    cycling through them read their weights from HBM, not from L2."""
    import awq_cupy

    t = random_gemm_tensors(rng, K, N, group_size) if tensors is None else tensors
    G = t["group_size"]
    w0 = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=dtype)
    nq = copies_for(w0.nbytes, rotate_mb)
    return [w0] + [awq_cupy.QuantizedWeight(qtiles=w0.qtiles.copy(), scales=w0.scales.copy(), zeros=w0.zeros.copy(),
                                            K=K, N=N, group_size=G, dtype=dtype) for _ in range(nq - 1)]


def layers(models) -> list[tuple[str, str, int, int]]:
    """(model, layer, K, N) rows of ``models``: names of ``MODELS``, or such rows already (``--shapes``)."""
    if all(isinstance(m, str) for m in models):
        return [(m, name, K, N) for m in models for (name, K, N) in MODELS[m]]
    return [tuple(m) for m in models]


def available_contenders(contenders) -> tuple[tuple[str, ...], dict[str, str]]:
    """The contenders that can run here, and why each peer that cannot is left out."""
    from .peers import PEERS

    skipped = {c: why for c in contenders if c in PEERS and (why := PEERS[c].unavailable()) is not None}
    return tuple(c for c in contenders if c not in skipped), skipped


def run(models, ms, dtype="float16", group_size=128, trials=5, rotate_mb=512, contenders=CONTENDERS,
        progress=True):
    """Benchmark rows for every (layer, M, contender) of ``models``: names of ``MODELS``, or (model, layer, K, N)
    rows. Peers (``peers.PEERS``) that cannot run here are left out with the reason printed."""
    import cupy

    import awq_cupy

    from . import launch, plans
    from .dtypes import numpy_dtype
    from .jit import arch_of_device
    from .peers import PEERS

    contenders, skipped = available_contenders(contenders)
    for c, why in skipped.items():
        print(f"contender {c} left out: {why}", file=sys.stderr)
    timer = Timer()
    arch = arch_of_device(cupy.cuda.runtime.getDevice())
    sms = launch.sm_count(cupy.cuda.runtime.getDevice())
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    shapes = layers(models)
    total = len(shapes) * len(ms)
    done = 0
    npdt = numpy_dtype(dtype)
    for model, name, K, N in shapes:
        t = random_gemm_tensors(rng, K, N, group_size)
        wq = rotated_weights(rng, K, N, group_size, dtype, rotate_mb, tensors=t)
        w0, nq, G = wq[0], len(wq), wq[0].group_size
        peer_calls = {c: PEERS[c].prepare([(t["qweight"], t["qzeros"], t["scales"])] * nq, K, N, G, dtype)
                      for c in contenders if c in PEERS}   # same weights as awq_cupy's, as many copies
        dense = awq_cupy.dequantize(w0)
        nd = max(2, -(-rotate_mb * 2**20 // dense.nbytes))
        wd = [dense] + [dense.copy() for _ in range(nd - 1)] if "cublas_fp16" in contenders else [dense]
        scratch = cupy.empty((K, N), dtype=dense.dtype) if "dequant_cublas" in contenders else None
        for M in ms:
            x = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32)).astype(cupy.float16)
            if dtype == "bfloat16":
                x = cupy.asarray(x.get().astype(np.float32).astype(npdt))
            y = cupy.empty((M, N), dtype=x.dtype)
            ref = cupy.matmul(x.astype(cupy.float32), dense.astype(cupy.float32))
            refmax = float(cupy.abs(ref).max()) + 1e-30

            def check(out):
                return float(cupy.abs(out.astype(cupy.float32) - ref).max()) / refmax

            calls = {
                "awq_cupy": lambda i: awq_cupy.matmul(x, wq[i % nq], out=y),
                "gemv": lambda i: launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, dtype, sms),
                **{f"gemv{t}": (lambda t: lambda i: launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, dtype, sms,
                                                                     tiles=t))(t) for t in (1, 2, 3, 4)},
                "gemv2x2": lambda i: launch.run_gemv(x, wq[i % nq], launch.NULL, y, M, dtype, sms, tiles=2, kdepth=2),
                "gemm": lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, dtype, arch, sms, False),
                "gemm_sw": lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, dtype, arch, sms, False,
                                                      wgmma=False),
                "gemm_wg": lambda i: launch.run_gemm(x, wq[i % nq], launch.NULL, y, M, dtype, arch, sms, False,
                                                      wgmma=True),
                "cublas_fp16": lambda i: cupy.matmul(x, wd[i % len(wd)], out=y),
                "dequant_cublas": lambda i: cupy.matmul(x, awq_cupy.dequantize(wq[i % nq], out=scratch), out=y),
                **{c: (lambda p: lambda i: p(i, x, y))(p) for c, p in peer_calls.items()},
            }
            res = {}
            for c in contenders:
                if c.startswith("gemv") and M > 16 and (c != "gemv" or not _gemv_exists(M, K, N, G, arch, sms)):
                    continue   # beyond 16 rows only the planned GEMV, where it has a variant (sm_90, whole blocks)
                if c == "gemm_wg" and not plans.has_wgmma(arch):
                    continue
                if c == "gemv2x2" and not plans.aligned_groups(wq[0].group_size, wq[0].NG):
                    continue   # two 64-k blocks per unit need groups of whole blocks
                y.fill(np.nan)
                calls[c](0)
                err = check(y)
                if not err < 2e-2:
                    raise RuntimeError(f"{c} gives wrong results for {name} {K}x{N} M={M}: max rel err {err:.3g}")
                n_calls = max(nq if c != "cublas_fp16" else len(wd), 20)
                us = timer(calls[c], n_calls, trials)
                res[c] = (us, err)
            base = res.get("cublas_fp16", (float("nan"),))[0]
            for c, (us, err) in res.items():
                b = _ideal_bytes(K, N, M, G, fp16_weights=(c == "cublas_fp16"))
                rows.append(Row(model, name, K, N, M, c, us, b / us * 1e-6, 2 * M * K * N / us * 1e-6,
                                base / us, err))
            done += 1
            if progress:
                msg = "  ".join(f"{c} {us:8.1f}us" for c, (us, _) in res.items())
                print(f"[{done:3d}/{total}] {model} {name:8s} M={M:5d}  {msg}", file=sys.stderr, flush=True)
        wq = wd = dense = scratch = calls = peer_calls = None   # release this layer's copies before the next layer
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _gemv_exists(M, K, N, G, arch, sm_count) -> bool:
    from . import plans

    try:
        plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sm_count)
    except ValueError:
        return False
    return True


def summarize(rows, contender="awq_cupy"):
    """Per model and M: sum of µs over the layers and the ratio of summed cuBLAS time to summed contender time."""
    out = {}
    for r in rows:
        key = (r.model, r.M)
        d = out.setdefault(key, {})
        d[r.contender] = d.get(r.contender, 0.0) + r.us
    return {k: dict(v, ratio=v.get("cublas_fp16", float("nan")) / v[contender]) for k, v in out.items()
            if contender in v}


def print_table(rows, env, file=sys.stdout):
    print(f"# {env.get('gpu')} (sm_{env.get('compute_capability')}, {env.get('sms')} SMs), "
          f"clocks {env.get('smi', {}).get('sm_clock', '?')} / mem {env.get('smi', {}).get('mem_clock', '?')}, "
          f"CUDA runtime {env.get('cuda_runtime')}, driver {env.get('cuda_driver')}, CuPy {env.get('cupy')}, "
          f"NVRTC {env.get('nvrtc')}, awq_cupy {env.get('awq_cupy')}", file=file)
    print(f"{'model':12s} {'layer':8s} {'K':>6s} {'N':>6s} {'M':>5s} {'contender':15s} {'us':>9s} "
          f"{'TB/s':>6s} {'%HBM':>5s} {'TFLOP/s':>8s} {'vs fp16':>8s}", file=file)
    for r in rows:
        print(f"{r.model:12s} {r.layer:8s} {r.K:6d} {r.N:6d} {r.M:5d} {r.contender:15s} {r.us:9.1f} "
              f"{r.tbps:6.2f} {100 * r.tbps / HBM_TBPS:5.0f} {r.tflops:8.1f} {r.ratio_vs_cublas:7.2f}x", file=file)
    print("\nsum over each model's four layers (us) and ratio cuBLAS fp16 / contender:", file=file)
    for contender in sorted({r.contender for r in rows} - {"cublas_fp16"}):
        for (model, M), d in sorted(summarize(rows, contender).items()):
            print(f"{model:12s} M={M:5d}  {contender:15s} {d[contender]:9.1f}  cublas_fp16 "
                  f"{d.get('cublas_fp16', float('nan')):9.1f}  ratio {d['ratio']:5.2f}x", file=file)


def plot(rows, path):
    """Speed-up of awq_cupy over cuBLAS fp16 against M, one line per layer shape (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r.model, r.layer, r.K, r.N) for r in rows})
    for model, layer, K, N in keys:
        pts = sorted((r.M, r.ratio_vs_cublas) for r in rows
                     if r.contender == "awq_cupy" and (r.model, r.layer) == (model, layer))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{model} {layer} {K}->{N}")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up vs cuBLAS fp16")
    models = ", ".join(dict.fromkeys(r.model for r in rows))
    ax.set_title(f"awq_cupy W4A16 on {models}" if rows else "awq_cupy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from ._array import gpu_available, no_gpu_message

    if not gpu_available():
        prog = getattr(args, "prog", "python -m awq_cupy")
        print(no_gpu_message(f"{prog} bench") + " Nothing was measured.", file=sys.stderr)
        return 2
    from . import bench_decode

    decode = getattr(args, "decode", False)
    sweep = not decode
    with_decode = decode or not getattr(args, "no_decode", False)
    env = environment()
    result = dict(env=env)
    rows = []
    if sweep:
        ms = QUICK_M if args.quick and args.m is None else DEFAULT_M if args.m is None else args.m
        if args.shapes:
            models = [("custom", f"{K}x{N}", K, N) for K, N in args.shapes]
        else:
            models = ["mistral-7b"] if args.quick else args.models
        print(f"benchmarking on {env['gpu']}: {len(ms)} values of M, dtype {args.dtype}, group {args.group_size}",
              file=sys.stderr)
        result.update(skipped_contenders=available_contenders(args.contenders)[1])   # run() prints why
        rows = run(models, ms, dtype=args.dtype, group_size=args.group_size, trials=3 if args.quick else args.trials,
                   rotate_mb=args.rotate_mb, contenders=tuple(args.contenders))
        result.update(method=__doc__.split("Method", 1)[1].strip(), dtype=args.dtype, group_size=args.group_size,
                      rows=[asdict(r) for r in rows],
                      summary=[dict(model=m, M=M, **d) for (m, M), d in sorted(summarize(rows).items())])
    drows, hrows = [], []
    if with_decode:
        dmodels = ["mistral-7b"] if args.quick else [m for m in args.models if m in bench_decode.DECODE_LAYERS]
        dms = tuple(m for m in (args.m or bench_decode.DECODE_M) if m <= 32) if decode else bench_decode.DECODE_M
        hrows = bench_decode.run_host(dms)
        for m in dmodels:
            drows += bench_decode.run_model(m, MODELS[m], dms, trials=3 if args.quick else args.trials)
        result.update(decode_method=bench_decode.__doc__.strip(), decode=drows, host_us=hrows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if rows and args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            print("matplotlib is not installed: no plot (pip install awq_cupy[plot])", file=sys.stderr)
    if rows:
        print_table(rows, env)
    if with_decode:
        bench_decode.print_decode(drows, hrows)
    return 0
