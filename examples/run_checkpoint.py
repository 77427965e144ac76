"""Load an AWQ checkpoint's layers onto the GPU and run them eagerly, fused and unfused.

    python examples/run_checkpoint.py PATH          # any AutoAWQ checkpoint folder (gemm/gemv/gemv_fast/marlin)
    python examples/run_checkpoint.py               # a small Llama-shaped demo checkpoint, made on the spot

What it shows: ``Checkpoint.to_gpu(fuse=True)`` (one call, layer by layer, q/k/v and gate/up fused), a plain
Python loop of ``awq_cupy.matmul`` calls over every weight with ``out=`` buffers (the eager host path, planned
once per call shape), the fused weights' outputs split back into their parts and checked against the unfused
layers, and the time of one pass over all layers for both. Timing uses CUDA events around whole passes on a
busy stream, after a warm-up pass (which compiles and plans), so it is wall time of the loop as a user sees it.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import awq_cupy


def demo_checkpoint(folder: Path, *, hidden=1024, inter=2816, kv=256, layers=4, group_size=128) -> Path:
    rng = np.random.default_rng(0)
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    qs = {f"model.layers.{i}.{n}": awq_cupy.quantize((rng.standard_normal(s) * 0.02).astype(np.float16), group_size)
          for i in range(layers) for n, s in shapes.items()}
    return awq_cupy.save_checkpoint(folder, qs, group_size=group_size, config={"model_type": "llama"},
                                    overwrite=True)


def one_pass(weights, xs, ys):
    for name, w in weights.items():
        awq_cupy.matmul(xs[w.K], w, out=ys[name])


def time_passes(weights, xs, ys, repeats: int) -> float:
    import cupy as cp

    one_pass(weights, xs, ys)                        # warm-up: compiles, plans every call shape
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        one_pass(weights, xs, ys)
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / repeats     # us per pass


def main(argv=None) -> int:
    import cupy as cp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", help="checkpoint folder (default: a demo checkpoint)")
    p.add_argument("--tokens", type=int, default=1, help="rows of x, M (default: 1, a decode step)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--repeats", type=int, default=20, help="timed passes (default: 20)")
    demo = p.add_argument_group("the demo checkpoint (without PATH)")
    demo.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    demo.add_argument("--hidden", type=int, default=1024, help="hidden size (default: 1024)")
    demo.add_argument("--kv", type=int, default=256, help="k/v output size (default: 256)")
    demo.add_argument("--inter", type=int, default=2816, help="MLP size (default: 2816)")
    args = p.parse_args(argv)

    path = Path(args.path) if args.path else demo_checkpoint(
        Path(tempfile.mkdtemp(prefix="awq_demo_")) / "m", hidden=args.hidden, inter=args.inter, kv=args.kv,
        layers=args.layers)
    with awq_cupy.load_checkpoint(path) as ckpt:
        print(ckpt)
        fused = ckpt.to_gpu(dtype=args.dtype, fuse=True, progress=True)
        separate = ckpt.to_gpu(dtype=args.dtype, fuse=False)
    dt = fused[next(iter(fused))]._xdtype
    rng = cp.random.default_rng(0)
    xs = {K: rng.standard_normal((args.tokens, K), dtype=cp.float32).astype(dt)
          for K in {w.K for w in separate.values()}}
    ys_f = {n: cp.empty((args.tokens, w.N), dtype=dt) for n, w in fused.items()}
    ys_s = {n: cp.empty((args.tokens, w.N), dtype=dt) for n, w in separate.items()}

    one_pass(fused, xs, ys_f)
    one_pass(separate, xs, ys_s)
    worst = 0.0
    for name, w in fused.items():
        parts = w.split(ys_f[name]) if w.parts else {name: ys_f[name]}
        for part, y in parts.items():
            ref = ys_s[part].astype(cp.float32)
            err = float(cp.abs(y.astype(cp.float32) - ref).max() / (cp.abs(ref).max() + 1e-30))
            worst = max(worst, err)
    n_fused = sum(1 for w in fused.values() if w.parts)
    t_f = time_passes(fused, xs, ys_f, args.repeats)
    t_s = time_passes(separate, xs, ys_s, args.repeats)
    gb = sum(w.nbytes for w in separate.values()) / 1e9
    print(f"{len(separate)} layers ({gb:.2f} GB on the GPU), {len(fused)} weights after fusing "
          f"({n_fused} fused), M = {args.tokens}, {args.dtype}")
    print(f"fused outputs vs separate layers: max relative difference {worst:.2e}")
    print(f"eager pass over all layers: separate {t_s:8.1f} us   fused {t_f:8.1f} us   ({t_s / t_f:.2f}x)")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
