"""A kernel of one's own on AWQ weights: the MLP's gate/up GEMV with ``silu(gate) * up`` in its epilogue.

    python examples/fused_gate_up_silu.py                    # Mistral-7B's MLP (K 4096, I 14336), fp16, M = 1
    python examples/fused_gate_up_silu.py --compile-only 90  # no GPU needed: compile and print ptxas's report

The kernel (``fused_gate_up_silu.cu``) reads a fused ``gate_up`` weight (``Checkpoint.to_gpu(fuse=True)`` makes
one) through ``kernels_cu/awq_cupy.cuh`` and is compiled by ``awq_cupy.jit.compile_file``. It is checked against
``awq_cupy.matmul`` followed by the same activation in CuPy, then both are timed with the benchmark's method
(``awq_cupy.bench.Timer``: queue preloaded, weight copies rotated beyond L2).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from awq_cupy import jit

SOURCE = Path(__file__).with_name("fused_gate_up_silu.cu")
NAMES = {"float16": "gate_up_silu_gemv<__half>", "bfloat16": "gate_up_silu_gemv<__nv_bfloat16>"}


def compile_for(arch=None) -> jit.Program:
    """The kernels for ``arch`` (default: this GPU's); bf16 from sm_80 on, like the library."""
    target = jit.resolve_arch(arch)
    return jit.compile_file(SOURCE, [NAMES["float16"]] + ([NAMES["bfloat16"]] if target.mma_k16 else []),
                            arch=target)


def gate_up_silu(x, w, out=None, *, program=None):
    """``silu(x @ W[:, :I]) * (x @ W[:, I:])`` for one row ``x [1, K]`` and a fused gate_up weight ``w``."""
    import cupy as cp

    L = w.layout()
    I = w.N // 2
    if w.N % 32 or (L.NG > 1 and L.group_size % 64):
        raise ValueError(f"needs N % 32 == 0 (got {w.N}) and group_size % 64 == 0 or one group (got "
                         f"{L.group_size}): a 16-column block of each half, a k block of 64 in one group")
    if x.shape != (1, w.K) or x.dtype != w._xdtype or not x.flags.c_contiguous:
        raise ValueError(f"x must be a C-contiguous [1, {w.K}] array of {w.dtype}, got {x.shape} {x.dtype}")
    out = cp.empty((1, I), dtype=x.dtype) if out is None else out
    k = (program or compile_for()).kernel(NAMES[w.dtype])
    k.launch((I // 16,), (128,), L.args() + (x, out), smem=16 * 8 * L.KS, pdl=jit.arch_of_device().pdl)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096, help="K (default: 4096)")
    p.add_argument("--inter", type=int, default=14336, help="I, the MLP size (default: 14336)")
    p.add_argument("--dtype", choices=list(NAMES), default="float16")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--compile-only", metavar="ARCH", help="compile for ARCH and print the report (no GPU)")
    p.add_argument("--check-only", action="store_true", help="check against the reference, skip the timing")
    args = p.parse_args(argv)
    if args.compile_only:
        print(compile_for(args.compile_only).report())
        return 0

    import cupy as cp

    import awq_cupy
    from awq_cupy.bench import Timer

    K, I = args.hidden, args.inter
    rng = cp.random.default_rng(0)
    dense = (rng.standard_normal((2 * I, K), dtype=cp.float32) * 0.02).astype(cp.float16)   # rows: gate, then up
    w = awq_cupy.QuantizedWeight.from_dense(dense, 128, dtype=args.dtype)
    x = (rng.standard_normal((1, K), dtype=cp.float32) * 0.5).astype(w._xdtype)
    program = compile_for()
    silu_mul = cp.ElementwiseKernel("T g, T u", "T y", "float a = (float)g; y = (T)(a / (1.f + expf(-a)) * (float)u)",
                                    "example_silu_mul")

    y = gate_up_silu(x, w, program=program)
    h = awq_cupy.matmul(x, w)
    ref = silu_mul(h[:, :I], h[:, I:]).astype(cp.float32)
    err = float(cp.abs(y.astype(cp.float32) - ref).max() / cp.abs(ref).max())
    if args.check_only:
        print(f"K = {K}, I = {I}, {args.dtype}, M = 1: fused vs matmul + silu*up: max relative difference {err:.2e}")
        return 0 if err < 2e-2 else 1

    copies = [w] + [awq_cupy.QuantizedWeight(qtiles=w.qtiles.copy(), scales=w.scales.copy(), zeros=w.zeros.copy(),
                                             K=K, N=2 * I, group_size=w.group_size, dtype=w.dtype)
                    for _ in range(max(1, -(-512 * 2**20 // w.nbytes)) - 1)]
    yf, yh, ya = cp.empty((1, I), x.dtype), cp.empty((1, 2 * I), x.dtype), cp.empty((1, I), x.dtype)
    timer, n = Timer(), max(20, len(copies))
    fused = timer(lambda i: gate_up_silu(x, copies[i % len(copies)], yf, program=program), n, args.trials)

    def unfused(i):
        awq_cupy.matmul(x, copies[i % len(copies)], out=yh)
        silu_mul(yh[:, :I], yh[:, I:], ya)

    pair = timer(unfused, n, args.trials)
    print(f"K = {K}, I = {I}, {args.dtype}, M = 1: fused vs matmul + silu*up: max relative difference {err:.2e}")
    print(f"fused kernel {fused:7.2f} us   matmul + silu*up {pair:7.2f} us   ({pair / fused:.2f}x)")
    print(program.report())
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
