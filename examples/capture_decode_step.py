"""A model-shaped stack of AWQ layers run as one CUDA graph, against the same Python loop run eagerly.

    python examples/capture_decode_step.py                  # 8 Mistral-7B-shaped decoder layers, M = 1
    python examples/capture_decode_step.py --layers 32 --tokens 16
    python examples/capture_decode_step.py --small          # small shapes (a quick check)

Each decoder layer is its four matmuls with fused weights (qkv, o, gate_up, down) and the elementwise work in
between that a real block has in the same places (attention itself is left out: the q columns stand in for its
output): ``h += o(q(qkv(rmsnorm(h))))``, ``h += down(silu(gate) * up)`` with ``gate_up(rmsnorm(h))``. Weights
are random, quantized on the GPU. ``awq_cupy.capture`` runs the step once eagerly, captures it, and the replay is
checked bitwise against an eager run from the same input before both are timed.
"""
from __future__ import annotations

import argparse

import awq_cupy

MISTRAL = dict(hidden=4096, q=4096, kv=1024, inter=14336)
SMALL = dict(hidden=512, q=512, kv=128, inter=1408)


def build(layers: int, dims: dict, dtype: str):
    import cupy as cp

    rng = cp.random.default_rng(0)
    H, Q, KV, inter = dims["hidden"], dims["q"], dims["kv"], dims["inter"]

    def weight(K, N):
        dense = (rng.standard_normal((N, K), dtype=cp.float32) * 0.02).astype(cp.float16)
        return awq_cupy.QuantizedWeight.from_dense(dense, 128, dtype=dtype)

    return [dict(qkv=weight(H, Q + 2 * KV), o=weight(Q, H), gate_up=weight(H, 2 * inter), down=weight(inter, H))
            for _ in range(layers)], (H, Q, inter)


def make_step(blocks, dims, M, dt):
    import cupy as cp

    H, Q, inter = dims
    h = cp.zeros((M, H), dtype=dt)
    bufs = dict(n=cp.empty((M, H), dt), qkv=cp.empty((M, blocks[0]["qkv"].N), dt), o=cp.empty((M, H), dt),
                gu=cp.empty((M, 2 * inter), dt), act=cp.empty((M, inter), dt), d=cp.empty((M, H), dt))
    rms = cp.ElementwiseKernel("T x, float32 r", "T y", "y = (T)((float)x * r)", "awq_example_rms")
    swiglu = cp.ElementwiseKernel("T g, T u", "T y", "float a = (float)g; y = (T)(a / (1.0f + expf(-a)) * (float)u)",
                                  "awq_example_swiglu")

    def norm(x, out):
        r = cp.reciprocal(cp.sqrt(cp.mean(cp.square(x.astype(cp.float32)), axis=-1, keepdims=True) + 1e-6))
        rms(x, r, out)

    def step():
        for b in blocks:
            norm(h, bufs["n"])
            awq_cupy.matmul(bufs["n"], b["qkv"], out=bufs["qkv"])
            q = cp.ascontiguousarray(bufs["qkv"][:, :Q])
            awq_cupy.matmul(q, b["o"], out=bufs["o"])
            h[...] += bufs["o"]
            norm(h, bufs["n"])
            awq_cupy.matmul(bufs["n"], b["gate_up"], out=bufs["gu"])
            swiglu(bufs["gu"][:, :inter], bufs["gu"][:, inter:], bufs["act"])
            awq_cupy.matmul(bufs["act"], b["down"], out=bufs["d"])
            h[...] += bufs["d"]
        return h

    return h, step


def main(argv=None) -> int:
    import cupy as cp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    p.add_argument("--tokens", type=int, default=1, help="rows, M (default: 1)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--small", action="store_true", help="small layer shapes instead of Mistral-7B's")
    p.add_argument("--repeats", type=int, default=20, help="timed steps (default: 20)")
    args = p.parse_args(argv)

    blocks, dims = build(args.layers, SMALL if args.small else MISTRAL, args.dtype)
    dt = blocks[0]["qkv"]._xdtype
    h, step = make_step(blocks, dims, args.tokens, dt)
    x0 = (cp.random.default_rng(1).standard_normal(h.shape, dtype=cp.float32) * 0.1).astype(dt)

    h[...] = x0
    graph = awq_cupy.capture(step)              # one eager run, then the capture
    h[...] = x0
    step()
    eager_out = h.copy()
    h[...] = x0
    graph()
    same = bool(cp.array_equal(h.view(cp.uint16), eager_out.view(cp.uint16)))

    def timed(run) -> float:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        run()
        start.record()
        for _ in range(args.repeats):
            run()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / args.repeats

    t_eager, t_graph = timed(step), timed(graph)
    shape = "small" if args.small else "Mistral-7B"
    print(f"{args.layers} {shape}-shaped decoder layers, M = {args.tokens}, {args.dtype}: "
          f"replay == eager bitwise: {same}")
    print(f"per step: eager {t_eager:.3f} ms   graph {t_graph:.3f} ms   ({t_eager / t_graph:.2f}x)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
