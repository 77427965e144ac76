"""Helpers for the GPU tests: random layers, the exact weight the kernels multiply, and a talking comparison."""
from __future__ import annotations

import numpy as np

from awq_cupy.formats import resolve_group_size


def bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def np_dtype(kind: str):
    return np.dtype(np.float16) if kind == "float16" else bf16()


def random_layer(rng, K, N, group_size):
    """Logical (Q, Z, S, G) with realistic fp16 scales (never zero)."""
    G = resolve_group_size(group_size, K)
    Q = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, size=(K // G, N), dtype=np.uint8)
    S = (rng.uniform(0.002, 0.02, size=(K // G, N)) * rng.choice([-1, 1], size=(K // G, N))).astype(np.float16)
    return Q, Z, S, G


def kernel_weight(Q, Z, S, G, kind, rounded=True):
    """float64 W [K, N] exactly as the kernels see it: T((q - z) * T(s)) with one rounding each, or with
    ``rounded=False`` the unrounded (q - z) * T(s) (the M <= 8 GEMV applies scales to fp32 sums)."""
    g = np.arange(Q.shape[0]) // G
    s32 = S.astype(np.float32)
    if kind == "bfloat16":
        s32 = s32.astype(bf16()).astype(np.float32)
    w32 = (Q.astype(np.float32) - Z[g].astype(np.float32)) * s32[g]
    return (w32.astype(np_dtype(kind)) if rounded else w32).astype(np.float64)


def either_weight(Q, Z, S, G, kind):
    """Both weights a matmul may validly multiply by: the rounded T((q - z) * T(s)) (the GEMMs, dequantize + cuBLAS,
    the scaled GEMV pairs) and the exact (q - z) * T(s) (the other GEMV variants). assert_matmul_close accepts an
    output that matches either one within its tolerance; which one a path uses is the dispatch's business, so the
    oracle does not ask the code under test (tests that pin a path's rounding use kernel_weight directly)."""
    return (kernel_weight(Q, Z, S, G, kind, rounded=True), kernel_weight(Q, Z, S, G, kind, rounded=False))


def gemv_weight(Q, Z, S, G, kind, M, tiles, kdepth=1):
    """The weight the GEMV variant of ``tiles`` blocks per unit (and ``kdepth`` 64-k blocks) multiplies by at M
    rows, as the variant declares it (kernels.GemvVariant.scaled, proved equal to the kernel's awq_gemv::Scaled by
    a static_assert when the family compiles)."""
    from awq_cupy.kernels import GemvVariant

    return kernel_weight(Q, Z, S, G, kind, rounded=GemvVariant(kind, -(-M // 8), tiles, True, kdepth).scaled)


def random_x(rng, M, K, kind, scale=1.0):
    return (rng.standard_normal((M, K)) * scale).astype(np_dtype(kind))


def assert_matmul_close(y, x, W64, kind, bias=None, what=""):
    """y (host, dtype kind) vs float64 x @ W64 (+ bias). Tolerance: one rounding of the output (2^-11 relative
    for fp16, 2^-8 for bf16) plus fp32 accumulation error (K * 2^-24 * sum|x w|, generous by 8x). ``W64`` may be
    a tuple of candidate weights (either_weight): y must then match one of them everywhere."""
    if isinstance(W64, tuple):
        errors = []
        for cand in W64:
            try:
                assert_matmul_close(y, x, cand, kind, bias, what)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{what}: matches none of the {len(W64)} valid weights:\n" + "\n".join(errors))
    x64 = x.astype(np.float64)
    ref = x64 @ W64
    if bias is not None:
        ref = ref + bias.astype(np.float64)
    mag = np.abs(x64) @ np.abs(W64)
    if bias is not None:
        mag = mag + np.abs(bias.astype(np.float64))
    K = x.shape[-1]
    u = 2.0 ** -11 if kind == "float16" else 2.0 ** -8
    tol = u * np.abs(ref) + 8 * K * 2.0 ** -24 * mag + 1e-30
    got = y.astype(np.float64)
    err = np.abs(got - ref)
    bad = ~(err <= tol)          # NaN counts as bad
    if bad.any():
        idx = np.argwhere(bad)
        first = [(tuple(i), float(ref[tuple(i)]), float(got[tuple(i)])) for i in idx[:5]]
        worst = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err / tol)), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} outputs off; worst at {worst}: "
                             f"ref={ref[worst]:.6g} got={got[worst]:.6g} tol={tol[worst]:.3g}; "
                             f"first (index, ref, got): {first}")


def two_per_sm_wgmma_variants(kind: str) -> list:
    """The wgmma variants of activation dtype ``kind`` that run two CTAs per SM by design: the PEND variants of
    kernels.GEMM_WG_PEND_TWO_PER_SM (aligned groups, after the x tile pass and through the tensor map) and the
    default shapes below 128 tokens (docs/design.md §wgmma GEMM (gemm_wg)). tests/test_kernels.py checks their
    compiled registers, tests/test_ops_gpu.py the occupancy the device reports."""
    from awq_cupy.kernels import GEMM_WG_DEFAULT, GEMM_WG_PEND_TWO_PER_SM, WgmmaVariant

    return ([WgmmaVariant(kind, *shape, True, pend, tma=tma)
             for shape, pend in GEMM_WG_PEND_TWO_PER_SM.items() for tma in (False, True)]
            + [WgmmaVariant(kind, *shape, ga) for tokens, shape in GEMM_WG_DEFAULT.items() if tokens < 128
               for ga in (True, False)])
