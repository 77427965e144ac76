"""GPU tests of the kernels behind the public API (marker ``gpu``; skipped with a reason without a GPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import awq_cupy
from awq_cupy import formats, layout, reference
from awq_cupy import settings
from conftest import FIXTURES
from gpu_util import (assert_matmul_close, gemv_weight, kernel_weight, either_weight, np_dtype, random_layer,
                      random_x, two_per_sm_wgmma_variants)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


def _gemm_tensors(Q, Z, S, G):
    return formats.pack(Q, Z, S, "gemm", G)


def _weight(Q, Z, S, G, kind):
    t = _gemm_tensors(Q, Z, S, G)
    return awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind)


def _run(x, w, bias=None, **kw):
    """matmul into a NaN-poisoned output, so unwritten elements fail."""
    xg = cp.asarray(x)
    out = cp.full(x.shape[:-1] + (w.N,), np.nan, dtype=xg.dtype)
    y = awq_cupy.matmul(xg, w, bias=None if bias is None else cp.asarray(bias), out=out, **kw)
    assert y is out and y.shape == x.shape[:-1] + (w.N,) and y.dtype == xg.dtype
    return y.get()


# ---------------------------------------------------------------------------------------------------------------
# Dequantize kernels
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K,N,G", [(256, 128, 128), (512, 72, 64), (4096, 1000, 128), (96, 24, -1), (384, 384, 32)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_dequantize_gemm_bit_exact(rng, K, N, G, kind):
    Q, Z, S, G = random_layer(rng, K, N, G)
    t = _gemm_tensors(Q, Z, S, G)
    out = cp.full((K, N), np.nan, dtype=np_dtype(kind))
    got = awq_cupy.dequantize_gemm(cp.asarray(t["qweight"]), cp.asarray(t["qzeros"]), cp.asarray(t["scales"]), G,
                                   dtype=kind, out=out).get()
    g = np.arange(K) // G
    expect = ((Q.astype(np.float32) - Z[g]) * S[g].astype(np.float32)).astype(np_dtype(kind))
    if kind == "float16":
        np.testing.assert_array_equal(got.view(np.uint16), reference.dequantize(Q, Z, S, G, np.float16).view(np.uint16))
    np.testing.assert_array_equal(got.view(np.uint16), expect.view(np.uint16))


@pytest.mark.parametrize("K,N,G", [(256, 128, 128), (4096, 1000, 128), (96, 24, -1), (1536, 384, 32)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_repack_and_dequantize_tiles_bit_exact(rng, K, N, G, kind):
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    np.testing.assert_array_equal(w.qtiles.get(), layout.pack_tiles(Q))
    got = awq_cupy.dequantize(w).get().astype(np.float64)
    np.testing.assert_array_equal(got, kernel_weight(Q, Z, S, G, kind))


# ---------------------------------------------------------------------------------------------------------------
# matmul against the float64 reference
# ---------------------------------------------------------------------------------------------------------------
M_ALL = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 118, 255, 256, 257, 1024]


@pytest.mark.parametrize("M", M_ALL)
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_all_m(rng, M, kind):
    K, N, G = 1536, 384, 128
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    x = random_x(rng, M, K, kind)
    assert_matmul_close(_run(x, w), x, either_weight(Q, Z, S, G, kind), kind, what=f"M={M} {kind}")


@pytest.mark.parametrize("K,N", [(4096, 6144), (14336, 4096), (11008, 4096), (384, 1536), (1536, 384), (4096, 1000)])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 257])
def test_matmul_model_shapes(rng, K, N, M):
    kind = "float16"
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, kind)
    x = random_x(rng, M, K, kind)
    assert_matmul_close(_run(x, w), x, either_weight(Q, Z, S, G, kind), kind, what=f"{K}x{N} M={M}")


@pytest.mark.parametrize("G", [32, 64, 128, -1])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("M", [1, 17, 118])
def test_matmul_group_sizes(rng, G, kind, M):
    K, N = 2048, 520
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    x = random_x(rng, M, K, kind)
    assert_matmul_close(_run(x, w, bias), x, either_weight(Q, Z, S, G, kind), kind, bias=bias,
                        what=f"G={G} {kind} M={M}")


@pytest.mark.parametrize("K,N,G", [(24, 8, -1), (40, 16, -1), (96, 24, 32), (200, 8, -1), (8, 64, -1)])
def test_matmul_tiny_and_odd_shapes(rng, K, N, G):
    kind = "float16"
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    for M in (1, 5, 40):
        x = random_x(rng, M, K, kind)
        assert_matmul_close(_run(x, w), x, either_weight(Q, Z, S, G, kind), kind, what=f"{K}x{N} G={G} M={M}")


def test_matmul_batched_leading_dims(rng):
    Q, Z, S, G = random_layer(rng, 512, 256, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = random_x(rng, 2 * 3 * 5, 512, "float16").reshape(2, 3, 5, 512)
    y = _run(x, w)
    assert y.shape == (2, 3, 5, 256)
    assert_matmul_close(y.reshape(30, 256), x.reshape(30, 512), either_weight(Q, Z, S, G, "float16"), "float16")


def test_large_magnitude_activations_do_not_overflow(rng):
    K, N = 4096, 512
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    # |x| near the fp16 range: partial products far beyond 65504 must stay in fp32 until the end
    x = (rng.uniform(-1, 1, (16, K)) * 30000).astype(np.float16)
    W64 = either_weight(Q, Z, S, G, "float16")
    ref = x.astype(np.float64) @ W64[0]
    scale = 60000.0 / np.abs(ref).max()
    x = (x.astype(np.float64) * scale).astype(np.float16)
    y = _run(x, w)
    assert np.isfinite(y).all()
    assert_matmul_close(y, x, W64, "float16", what="large |x|")


def test_nan_propagates_to_its_row_only(rng):
    K, N = 1024, 256
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    for M in (4, 40):
        x = random_x(rng, M, K, "float16")
        x[2, 100] = np.nan
        y = _run(x, w)
        assert np.isnan(y[2]).all()
        rest = np.delete(np.arange(M), 2)
        assert np.isfinite(y[rest]).all()
        assert_matmul_close(y[rest], x[rest], either_weight(Q, Z, S, G, "float16"), "float16")


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint formats: all four load into the same weight
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K,N,G", [(512, 256, 128), (1408, 64, 128), (384, 384, 64)])
def test_all_formats_give_the_same_output(rng, K, N, G):
    """The four checkpoint formats of one layer repack to the same weight: identical dequantized weights,
    bitwise identical outputs on the batch-invariant path, and outputs within fp16 noise of the reference on
    the default path."""
    Q, Z, S, G = random_layer(rng, K, N, G)
    x_host = random_x(rng, 9, K, "float16")
    x = cp.asarray(x_host)
    dense, exact, default = {}, {}, {}
    fmts = {"gemm": (Q, Z), "gemv": (Q, Z), "gemv_fast": (Q, Z)}
    if N % 64 == 0 and K % 16 == 0:   # marlin is symmetric: compare it with a gemm layer whose Z = 8
        fmts["marlin"] = (Q, np.full_like(Z, 8))
        fmts["gemm_z8"] = (Q, np.full_like(Z, 8))
    for name, (q, z) in fmts.items():
        fmt = "gemm" if name == "gemm_z8" else name
        w = awq_cupy.QuantizedWeight.from_checkpoint(formats.pack(q, z, S, fmt, G), fmt, G)
        dense[name] = awq_cupy.dequantize(w).get().view(np.uint16)
        exact[name] = awq_cupy.matmul(x, w, batch_invariant=True).get().view(np.uint16)
        default[name] = awq_cupy.matmul(x, w).get()
        ref_w = either_weight(q, z, S, G, "float16")
        assert_matmul_close(default[name], x_host, ref_w, "float16", what=f"{name} default path")
    for name in ("gemv", "gemv_fast"):
        np.testing.assert_array_equal(dense[name], dense["gemm"], err_msg=name)
        np.testing.assert_array_equal(exact[name], exact["gemm"], err_msg=name)
    if "marlin" in fmts:
        np.testing.assert_array_equal(dense["marlin"], dense["gemm_z8"])
        np.testing.assert_array_equal(exact["marlin"], exact["gemm_z8"])


@pytest.mark.parametrize("M", [1024, 1100])
def test_cublas_path_and_fused_gemm_agree_with_reference(rng, M):
    from awq_cupy.plans import uses_cublas

    K, N = 2048, 768
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = random_x(rng, M, K, "float16")
    W64 = either_weight(Q, Z, S, G, "float16")
    assert uses_cublas(M, "float16", K=K, N=N), "the dispatch table changed: pick M values on the cuBLAS path"
    assert_matmul_close(_run(x, w), x, W64, "float16", what=f"cuBLAS path M={M}")
    assert_matmul_close(_run(x, w, batch_invariant=True), x, W64, "float16", what=f"fused GEMM M={M}")


def test_golden_fixtures_through_matmul(rng):
    index = json.loads((FIXTURES / "index.json").read_text())
    for entry in index:
        t = load_file(str(FIXTURES / entry["file"]))
        K, N, G = entry["in_features"], entry["out_features"], entry["group_size"]
        packed = {k: v for k, v in t.items() if k in ("qweight", "qzeros", "scales", "bias")}
        w = awq_cupy.QuantizedWeight.from_checkpoint(packed, entry["format"], G)
        x = random_x(rng, 5, K, "float16")
        y = _run(x, w, t["bias"])
        Q, Z, S = formats.unpack(packed, entry["format"], K, G)
        Gr = formats.resolve_group_size(G, K)
        if entry["format"] != "gemv_fast":   # gemv_fast stores -s*z rounded, so its fake-quant differs by 1 ulp
            np.testing.assert_array_equal(kernel_weight(Q, Z, S, Gr, "float16"),
                                          t["weight_fake_quant"].astype(np.float64).T)
        W64 = either_weight(Q, Z, S, Gr, "float16")
        assert_matmul_close(y, x, W64, "float16", bias=t["bias"], what=entry["file"])


# ---------------------------------------------------------------------------------------------------------------
# The GEMV (M <= 16): every variant, awkward splits, determinism, row independence
# ---------------------------------------------------------------------------------------------------------------
def _gemv(x, w, tiles, bias=None, **plan):
    """Run the GEMV variant with ``tiles`` column blocks per unit directly (whatever the dispatch table says)."""
    from awq_cupy import launch

    xg = cp.asarray(x)
    M = x.shape[0]
    y = cp.full((M, w.N), np.nan, dtype=xg.dtype)
    b = cp.asarray(bias) if bias is not None else launch.NULL
    launch.run_gemv(xg, w, b, y, M, w.dtype, launch.sm_count(w.device), tiles=tiles, **plan)
    return y.get()


# Shapes: model layers, K not a multiple of 64, one group (G = K), G = 32 and 96 (two groups per 64-k unit),
# fewer units than warps, a single column group, and N/K so large that warps' runs cross many groups.
GEMV_SHAPES = [(4096, 1024, 128), (1000, 200, -1), (384, 4160, 32), (768, 96, 96), (64, 28672, 64),
               (14336, 64, 128), (8, 8, -1), (2048, 520, 64)]


@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
@pytest.mark.parametrize("K,N,G", GEMV_SHAPES)
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_gemv_variants_against_reference(rng, tiles, K, N, G, kind):
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import gemv_shapes
    from awq_cupy.plans import aligned_groups

    instantiated = gemv_shapes(arch_of_device(0), aligned_groups(G, K // G))   # three, four token blocks: sm_90
    for M in (1, 3, 8, 9, 16, 17, 24, 25, 32):
        if (-(-M // 8), tiles) not in instantiated:
            continue
        x = random_x(rng, M, K, kind)
        W64 = gemv_weight(Q, Z, S, G, kind, M, tiles)
        assert_matmul_close(_gemv(x, w, tiles, bias), x, W64, kind, bias=bias,
                            what=f"GEMV tiles={tiles} {K}x{N} G={G} M={M} {kind}")


@pytest.mark.parametrize("K,N,G", [(4096, 1024, 128), (1000, 200, -1), (1088, 4160, 64), (1152, 520, 192),
                                   (64, 28672, 64), (14336, 64, 128), (8, 8, -1), (2048, 16 * 137, 128)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_gemv_two_k_blocks_per_unit_against_reference(rng, K, N, G, kind):
    """The pair variants with two 64-k blocks per unit (kdepth 2): an odd number of k blocks (K = 1088, 1000, 8, 64:
    the last unit's second block lies past K), groups of one, two and three blocks (G = 64, 128, 192: a unit's
    second block may start a new group), one group (G = K), column groups short and long (N = 16 x 137: CTAs of
    one and two blocks), warp counts down to one."""
    from awq_cupy import launch, plans
    from awq_cupy.kernels import GEMV_KD2_SHAPES

    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    W64 = kernel_weight(Q, Z, S, G, kind, rounded=False)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    for nb, tiles in GEMV_KD2_SHAPES:
        for M in (8 * nb - 7, 8 * nb):
            x = random_x(rng, M, K, kind)
            most = plans.plan_gemv(M, K, N, G, tiles=tiles, kdepth=2, sm_count=launch.sm_count(0)).warps
            for warps in sorted({most, 5, 1}):
                y = _gemv(x, w, tiles, bias, warps=warps, kdepth=2)
                assert_matmul_close(y, x, W64, kind, bias=bias,
                                    what=f"GEMV kdepth 2 tiles={tiles} {K}x{N} G={G} M={M} warps={warps} {kind}")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_takes_two_k_block_pairs_where_planned(rng, kind):
    """A layer of two 16-column blocks per CTA (4096 x 4096, like Mistral-7B's o) runs the two-k-block pairs through
    matmul's own plan where the dispatch table says so (up to 8 rows), and from 9 rows the plain pairs, which
    multiply by the rounded weights (16 warps on sm_90); both give the reference's result."""
    from awq_cupy import kernels, launch, plans
    from awq_cupy.jit import arch_of_device

    K, N = 4096, 4096
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, kind)
    for M in (1, 8, 9, 16):
        W64 = either_weight(Q, Z, S, G, kind)
        arch, sms = arch_of_device(0), launch.sm_count(0)
        plan = plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, dtype=kind)
        assert plan.kdepth == (2 if M <= 8 else 1), (M, plan)
        if M > 8:
            assert plan.tiles == 2 and plan.scaled and plans.rounds_weights(
                M, arch_key=arch.key, K=K, N=N, group_size=G, dtype=kind, sm_count=sms), (M, plan)
            assert plan.warps == (16 if arch.gemv_scaled_16_warps else 12), (M, plan)
        x = random_x(rng, M, K, kind)
        assert_matmul_close(_run(x, w), x, W64, kind, what=f"matmul {K}x{N} M={M} {kind} kdepth={plan.kdepth}")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_takes_the_wide_gemv_where_planned(rng, kind):
    """From 17 to 32 rows matmul runs the GEMV's three- and four-token-block variants on the layers
    plans.gemv_wide_takes gives them (sm_90, groups of whole 64-k blocks; exact (q - z) with the scales on fp32
    group sums) and the GEMM elsewhere (rounded weights); both give the reference's result, with a bias, N not a
    multiple of 64 and a CTA's last column group short."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device

    arch, sms = arch_of_device(0), launch.sm_count(0)
    # small (GEMV at every M), CTAs of 6-7 blocks with K x N past the small-layer bound (GEMV up to 24 rows),
    # two blocks per CTA past it (the GEMM), one group of K
    shapes = [(4096, 6144 - 40, 128), (2560, 16 * (6 * sms + sms // 2), 64), (8192, 16 * 2 * sms, 128),
              (1000, 16 * 2 * sms + 8, -1)]
    taken = set()
    for K, N, G in shapes:
        Q, Z, S, G = random_layer(rng, K, N, G)
        w = _weight(Q, Z, S, G, kind)
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        for M in (17, 20, 24, 25, 31, 32):
            takes = plans.gemv_wide_takes(M, K, N, G, arch, sms, kind)
            assert plans.rounds_weights(M, arch_key=arch.key, K=K, N=N, group_size=G, dtype=kind,
                                      sm_count=sms) == (not takes)
            taken.add((K, N, M, takes))
            x = random_x(rng, M, K, kind)
            assert_matmul_close(_run(x, w, bias), x, either_weight(Q, Z, S, G, kind), kind, bias=bias,
                                what=f"matmul {K}x{N} G={G} M={M} {kind} wide GEMV={takes}")
    if arch.gemv_wide and sms >= 100:   # the H100 / H200 rule's layer choice
        assert {(K, N) for K, N, M, t in taken if t and M == 32} == {(4096, 6104), (1000, 16 * 2 * sms + 8)}
        assert {(K, N) for K, N, M, t in taken if t and M == 24} == {(4096, 6104), (2560, 16 * (6 * sms + sms // 2)),
                                                                     (1000, 16 * 2 * sms + 8)}
        assert not any(t for K, N, M, t in taken if K == 8192)


def test_gemv_every_warp_count(rng):
    K, N, G = 2048, 4160, 128
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, "float16")
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import gemv_shapes

    for nb, tiles in gemv_shapes(arch_of_device(0)):
        M = 8 * nb - 3
        x = random_x(rng, M, K, "float16")
        W64 = gemv_weight(Q, Z, S, G, "float16", M, tiles)
        for warps in (16, 12, 7, 4, 1):
            try:
                y = _gemv(x, w, tiles, warps=warps)
            except ValueError:      # more warps than the variant is compiled for
                continue
            assert_matmul_close(y, x, W64, "float16", what=f"tiles={tiles} warps={warps} M={M}")


@pytest.mark.parametrize("G", [64, 32])
def test_gemv_short_column_groups_against_reference(rng, G):
    """CTAs of 6 and 7 column blocks (N = 16 (6.5 x SMs)), so that with 2, 3 or 4 blocks per unit a CTA's last
    column group is short and the warps' runs end inside and across groups; K = 1088 (17 units per block, odd), two
    scale groups per unit at G = 32; every warp count down to one."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import gemv_shapes

    instantiated = gemv_shapes(arch_of_device(0), G % 64 == 0)
    sms = launch.sm_count(0)
    K, N = 1088, 16 * (6 * sms + sms // 2)
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, "float16")
    for nb, tiles in instantiated:
        if tiles == 1:
            continue
        M = 8 * nb - 5
        x = random_x(rng, M, K, "float16")
        W64 = gemv_weight(Q, Z, S, G, "float16", M, tiles)
        most = plans.plan_gemv(M, K, N, G, sm_count=sms, tiles=tiles).warps
        for warps in sorted({most, 7, 2, 1}):
            y = _gemv(x, w, tiles, warps=warps)
            assert_matmul_close(y, x, W64, "float16", what=f"tiles={tiles} warps={warps} M={M} G={G}")


def test_gemv_is_deterministic_and_rows_are_independent(rng):
    """Bitwise the same run to run; and a row's result does not depend on the other rows whenever the launch
    plan (warps per CTA, blocks per unit) is the same, since the summation order depends only on the plan."""
    from awq_cupy.plans import plan_gemv

    K, N = 14336, 4096
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = random_x(rng, 32, K, "float16")
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import GemvVariant, gemv_shapes

    instantiated = gemv_shapes(arch_of_device(0))
    for tiles in (1, 2, 3, 4):
        rows = np.concatenate([_gemv(x[i:i + 1], w, tiles) for i in range(32)])
        one = plan_gemv(1, K, N, G, tiles=tiles)
        for M in (3, 8, 16, 24, 32):
            if (-(-M // 8), tiles) not in instantiated:
                continue
            a, b = _gemv(x[:M], w, tiles), _gemv(x[:M], w, tiles)
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"run to run, M={M}")
            # the same plan, and the same decode (GemvVariant.scaled: the pairs at two token blocks round)
            if (plan_gemv(M, K, N, G, tiles=tiles).warps == one.warps
                    and GemvVariant("float16", -(-M // 8), tiles).scaled == GemvVariant("float16", 1, tiles).scaled):
                np.testing.assert_array_equal(a.view(np.uint16), rows[:M].view(np.uint16), err_msg=f"rows, M={M}")


@pytest.mark.parametrize("K,N,G", [(4096, 4096, 128), (1088, 4160, 64), (2112, 2000, 32), (1000, 4200, -1),
                                   (14400, 328, 96)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_gemv_compiled_for_the_launch_shape(rng, K, N, G, kind, monkeypatch):
    """The GEMV compiled for one launch shape (launch.gemv_kernel with specialize=True; what matmul runs on compute
    capability 9.0 for model-sized weights; at M = 1 and 16 compiled for the token count too, M = 1 here at every
    size) gives bitwise the generic variant's result, and the reference's, for every planned variant (pairs with two
    k blocks, threes, fours; G % 64 = 32; one group; N not a multiple of 64), with and without a bias, at one to
    four token blocks (three and four on sm_90 with groups of whole 64-k blocks) and other warp counts. Runs on any
    GPU (the constants are not arch-specific)."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import gemv_shapes

    monkeypatch.setattr(plans, "GEMV_M1_MIN_WEIGHTS", 0)

    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    arch, sms = arch_of_device(0), launch.sm_count(0)
    for M in (1, 5, 9, 16, 20, 32):
        x = random_x(rng, M, K, kind)
        xg = cp.asarray(x)
        if M > 16 and not any(nb == -(-M // 8) for nb, _ in gemv_shapes(arch, plans.aligned_groups(G, K // G))):
            continue   # three and four token blocks: sm_90, groups of whole 64-k blocks
        base = plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, dtype=kind)
        W64 = gemv_weight(Q, Z, S, G, kind, M, base.tiles, base.kdepth)
        for warps in sorted({base.warps, 3}):
            p = plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, dtype=kind, tiles=base.tiles,
                              kdepth=base.kdepth, warps=warps)
            for b in (None, bias):
                ys = []
                for spec in (False, True):
                    y = cp.full((M, N), np.nan, dtype=xg.dtype)
                    args = launch.gemv_args(xg, w, launch.NULL if b is None else cp.asarray(b), y, M, p)
                    launch.gemv_kernel(w, p, kind, arch, M, specialize=spec).launch(
                        (p.grid,), (32 * p.warps,), args, smem=p.smem, pdl=plans.uses_pdl(arch))
                    ys.append(y.get())
                what = f"{K}x{N} G={G} M={M} warps={warps} bias={b is not None} {kind} {p}"
                np.testing.assert_array_equal(ys[1].view(np.uint16), ys[0].view(np.uint16), err_msg=what)
                assert_matmul_close(ys[1], x, W64, kind, bias=b, what=what)


# ---------------------------------------------------------------------------------------------------------------
# The swapped GEMM (M > 12): every variant, forced split counts, awkward shapes
# ---------------------------------------------------------------------------------------------------------------
def _gemm(x, w, tiles, splits=None, bias=None, wgmma=False, pend=None, reduce_cols=None, ksplit=1, tail=None,
          token_tile=None, producers=None, tma=None):
    """Run the GEMM (the wgmma or the mma.sync kernel) with ``tiles`` column blocks per warp (and ``splits``, the
    wgmma kernel's ``pend``, the split-K reduce kernel's columns per thread, a forced ``tail`` launch, a forced
    ``token_tile``, its x producers or tensor-map variant forced on or off)."""
    from awq_cupy import launch
    from awq_cupy.jit import arch_of_device

    xg = cp.asarray(x)
    M = x.shape[0]
    y = cp.full((M, w.N), np.nan, dtype=xg.dtype)
    b = cp.asarray(bias) if bias is not None else launch.NULL
    launch.run_gemm(xg, w, b, y, M, w.dtype, arch_of_device(w.device), launch.sm_count(w.device), False,
                     tiles=tiles, splits=splits, wgmma=wgmma, pend=pend, reduce_cols=reduce_cols, ksplit=ksplit,
                     tail=tail, token_tile=token_tile, producers=producers, tma=tma)
    return y.get()


def _has_wgmma():
    from awq_cupy.jit import arch_of_device
    from awq_cupy.plans import has_wgmma

    return has_wgmma(arch_of_device(0))


def _gemm_cases():
    from awq_cupy.kernels import GEMM_SHAPES, GEMM_WG_SHAPES

    return [("mma", s) for s in GEMM_SHAPES] + [("wgmma", s) for s in GEMM_WG_SHAPES]


# K not a multiple of 64, one group (G = K), G = 32 and 96 (two groups per 64-k unit), a single column tile,
# N not a multiple of 16 columns per warp, more units than one split holds.
GEMM_TEST_SHAPES = [(4096, 1024, 128), (1000, 200, -1), (384, 4160, 32), (768, 96, 96), (2048, 520, 64),
                    (14336, 64, 128), (8, 8, -1)]


@pytest.mark.parametrize("path,shape", _gemm_cases())
@pytest.mark.parametrize("K,N,G", GEMM_TEST_SHAPES)
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_gemm_variants_against_reference(rng, path, shape, K, N, G, kind):
    from awq_cupy.plans import gemm_token_tile

    wg = path == "wgmma"
    if wg and not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    nb, tw, _ = shape
    tile = 8 * nb
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    W64 = kernel_weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    lo = tile // 2 + 1            # the smallest M that takes this token tile
    # the tile's smallest and largest M, a forced split count, and three token tiles (the last one 5 rows)
    for M, splits in ((lo, None), (tile, 1), (tile - 3, 3), (2 * tile + 5, None)):
        if M <= tile and gemm_token_tile(M, wg) != tile:
            continue
        splits = None if splits is None else min(splits, w.KS)
        x = random_x(rng, M, K, kind)
        assert_matmul_close(_gemm(x, w, tw, splits, bias, wg, token_tile=tile), x, W64, kind, bias=bias,
                            what=f"GEMM {path} {shape} splits={splits} {K}x{N} G={G} M={M} {kind}")


# More column tiles than one wave of 256-token CTAs holds: K not a multiple of 64 with one group, N not a multiple
# of the 128-column tile (the tail's last tile has 8 columns), G = 128 with a tail of a few tiles; two K streams
# (64-column tiles) on Mistral-7B qkv's grid with N % 16 = 8, with groups of 128 and one group of K % 64 = 8
@pytest.mark.parametrize("K,N,G,ksplit", [(2056, 18824, -1, 1), (1024, 17416, 128, 1), (4096, 6152, 128, 2),
                                          (4104, 6152, -1, 2)])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("tma", [False, True])
def test_gemm_tail_launch_against_reference(rng, K, N, G, ksplit, kind, tma):
    """The wgmma GEMM as whole waves of unsplit column tiles plus a split tail launch (plans.TailSplit): against
    the reference with and without bias, and the unsplit columns bitwise those of the unsplit one-launch plan;
    after the x tile pass and with x through a tensor map (both launches reading x by one map); one K stream, and
    two (their tail forced; planned only with plans._KSPLIT_TMA_TAILS)."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    Q, Z, S, G = random_layer(rng, K, N, G)
    w = _weight(Q, Z, S, G, kind)
    W64 = kernel_weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    arch, sms = arch_of_device(w.device), launch.sm_count(w.device)
    for M in (257, 300, 512):
        p = plans.plan_gemm_launch(M, K, N, G, kind, arch, sms, launch._resident(w.device), wgmma=True, tail=True,
                                   tma=tma, ksplit=ksplit)
        q = plans.plan_gemm_launch(M, K, N, G, kind, arch, sms, launch._resident(w.device), wgmma=True, tail=False,
                                   tma=tma, ksplit=ksplit, splits=1)
        assert p.tail is not None and p.tail.splits >= 2 and q.splits == 1, (p, q)
        assert p.tma == q.tma == tma and p.ksplit == q.ksplit == ksplit, (p, q)
        x = random_x(rng, M, K, kind)
        for b in (None, bias):
            what = f"tail {K}x{N} G={G} M={M} bias={b is not None} {kind} {p}"
            y = _gemm(x, w, None, None, b, True, tail=True, tma=tma, ksplit=ksplit)
            assert_matmul_close(y, x, W64, kind, bias=b, what=what)
            n0 = 16 * p.tail_block0
            one = _gemm(x, w, None, 1, b, True, tail=False, tma=tma, ksplit=ksplit)
            np.testing.assert_array_equal(y[:, :n0].view(np.uint16), one[:, :n0].view(np.uint16), err_msg=what)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_pair_grid_tail_against_reference(rng, kind, monkeypatch):
    """The 128-token tile at two CTAs per SM (PEND 2) on more column tiles than one wave of pairs holds: matmul
    plans whole waves and a split tail launch (plans.pair_sm_terms, with plans.PAIR_TAILS on) at M = 100 (a partial
    token tile) and 128, N % 16 = 8; close to the reference with a bias, and the unsplit columns bitwise those of
    the one-launch plan."""
    from awq_cupy import launch, plans

    monkeypatch.setattr(plans, "PAIR_TAILS", True)
    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    K, N = 4096, 36872   # 289 column tiles of 128: 264 in one wave of pairs, then 25
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, kind)
    W64 = kernel_weight(Q, Z, S, G, kind)
    bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
    for M in (100, 128):
        p = launch.prepare_call(w, M, kind, cp.cuda.get_current_stream().ptr).plan
        if not (isinstance(p, plans.GemmPlan) and p.pend is not None and p.tail is not None):
            pytest.skip(f"no two-per-SM tail planned on this GPU ({launch.sm_count(w.device)} SMs) at M={M}: {p}")
        assert p.grid[0] == 2 * launch.sm_count(w.device) and p.tail.splits >= 2, p
        x = random_x(rng, M, K, kind)
        y = _run(x, w, bias)
        assert_matmul_close(y, x, W64, kind, bias=bias, what=f"pair tail M={M} {kind} {p}")
        n0 = 16 * p.tail_block0
        one = _gemm(x, w, None, 1, bias, True, tail=False, pend=p.pend)
        np.testing.assert_array_equal(y[:, :n0].view(np.uint16), one[:, :n0].view(np.uint16), err_msg=str(p))


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_row_split_against_reference(rng, kind):
    """M rows past whole 256-token tiles as two calls (plans.RowSplit): 256 + 1 rows (the rest on the GEMV), 256 +
    44 (a 64-token tile) and 512 + 8, N % 16 = 8, with a bias: close to the reference, bitwise the two calls on the
    row slices, and a captured CUDA graph of it replays bitwise what the eager call gives."""
    from awq_cupy import launch, plans

    if not _has_wgmma():
        pytest.skip("the row split is planned for the wgmma GEMM (compute capability 9.0)")
    K, N = 1024, 16392
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, kind)
    W64 = kernel_weight(Q, Z, S, G, kind)
    bias = cp.asarray((rng.standard_normal(N) * 0.1).astype(np_dtype(kind)))
    stream = cp.cuda.get_current_stream().ptr
    for M in (257, 300, 520):
        pc = launch.prepare_call(w, M, kind, stream)
        if not isinstance(pc.plan, plans.RowSplit):
            pytest.skip(f"no row split planned on this GPU for M={M} ({launch.sm_count(w.device)} SMs): {pc.plan}")
        rows = pc.plan.rows
        assert rows == 256 * (M // 256)
        x = cp.asarray(random_x(rng, M, K, kind))
        y = awq_cupy.matmul(x, w, bias=bias)
        assert_matmul_close(y.get(), x.get(), W64, kind, bias=bias.get(), what=f"row split M={M} {kind}")
        parts = [awq_cupy.matmul(x[:rows], w, bias=bias), awq_cupy.matmul(x[rows:], w, bias=bias)]
        np.testing.assert_array_equal(y.get().view(np.uint16), cp.concatenate(parts).get().view(np.uint16))
        out = cp.full((M, N), np.nan, dtype=x.dtype)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            awq_cupy.matmul(x, w, bias=bias, out=out)   # this stream's prepared call, outside the capture
            s.begin_capture()
            awq_cupy.matmul(x, w, bias=bias, out=out)
            g = s.end_capture()
        out.fill(np.nan)
        cp.cuda.get_current_stream().synchronize()
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(out.get().view(np.uint16), y.get().view(np.uint16))


@pytest.mark.parametrize("path", ["mma", "wgmma"])
def test_gemm_is_deterministic_and_split_count_only_matters(rng, path):
    """Bitwise the same run to run; a row's result depends on the split count, not on M or the shape."""
    from awq_cupy.kernels import GEMM_SHAPES, GEMM_WG_SHAPES

    wg = path == "wgmma"
    if wg and not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    K, N = 4096, 1536
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = random_x(rng, 300, K, "float16")
    ref = _gemm(x[:13], w, 2, splits=4, wgmma=wg)
    for nb, tw, _ in GEMM_WG_SHAPES if wg else GEMM_SHAPES:
        tile = 8 * nb
        for M in (tile - 3, 300) if tile == max(8 * s[0] for s in (GEMM_WG_SHAPES if wg else GEMM_SHAPES)) else (tile - 3,):
            a, b = _gemm(x[:M], w, tw, splits=4, wgmma=wg), _gemm(x[:M], w, tw, splits=4, wgmma=wg)
            what = f"{path} M={M} shape={(nb, tw)}"
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"run to run {what}")
            np.testing.assert_array_equal(a[:13].view(np.uint16), ref.view(np.uint16), err_msg=f"rows {what}")


def test_wgmma_x_tile_pass_strides_over_its_grid(rng):
    """awq_tile_x_kernel runs at most 65536 blocks of 256 threads, one 16-byte chunk each per pass: with more than
    2^24 chunks (here M = 8200 rows of K = 16384 in 128-token tiles: 65 tiles x 256 units x 1024 chunks) threads
    take a second chunk 2^24 further on (its 64-bit index). The pass runs before the variants without x producers:
    the 128-token tile's PEND = 2 one. The GEMM on those tiles against the reference, and the same call through the
    planned 256-token variant, whose producer warps copy x (256 MB) themselves."""
    from awq_cupy.kernels import GEMM_WG_PEND_TWO_PER_SM
    from awq_cupy.plans import x_tile_chunks

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    K, N, M = 16384, 40, 8200
    (shape, pend), = GEMM_WG_PEND_TWO_PER_SM.items()
    assert x_tile_chunks(M, K, 8 * shape[0]) > 65536 * 256
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "bfloat16")
    W64 = kernel_weight(Q, Z, S, G, "bfloat16")
    x = random_x(rng, M, K, "bfloat16")
    y = _gemm(x, w, shape[1], None, None, wgmma=True, pend=pend, token_tile=8 * shape[0])
    assert_matmul_close(y, x, W64, "bfloat16", what=f"{M}x{K}x{N} x tile strides")
    y = _gemm(x, w, None, None, None, wgmma=True)
    assert_matmul_close(y, x, W64, "bfloat16", what=f"{M}x{K}x{N} x producers")


def test_wgmma_x_producers_give_the_tile_pass_bits(rng):
    """The variants whose producer warps copy x into shared memory (kernels.WgmmaVariant.producers) build the same
    image awq_tile_x_kernel writes and run the same wgmmas: bitwise the result of the same shape after the pass, for
    every producer shape, one and two K streams, split K, K not a multiple of 64, a last token tile of 5 rows (and of
    one row), M inside one group of four rows; and close to the reference."""
    from awq_cupy.kernels import GEMM_WG_PRODUCER_SHAPES

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    for K, N, G, kind in ((1000, 200, -1, "float16"), (4096, 1032, 128, "bfloat16"), (768, 96, 96, "float16")):
        Q, Z, S, G = random_layer(rng, K, N, G)
        w = _weight(Q, Z, S, G, kind)
        W64 = kernel_weight(Q, Z, S, G, kind)
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        for nb, tw, _ in GEMM_WG_PRODUCER_SHAPES:
            tile = 8 * nb
            for M, splits, ksplit in ((tile + 5, None, 1), (3, 1, 1), (tile - 1, min(3, w.KS), 1), (tile + 1, 1, 2),
                                      (2 * tile, min(3, w.KS), 2)):
                x = random_x(rng, M, K, kind)
                run = dict(tiles=tw, splits=splits, bias=bias, wgmma=True, ksplit=ksplit, token_tile=tile)
                what = f"{(nb, tw)} {K}x{N} G={G} M={M} splits={splits} ksplit={ksplit} {kind}"
                a = _gemm(x, w, producers=True, **run)
                b = _gemm(x, w, producers=False, tma=False, **run)
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=what)
                assert_matmul_close(a, x, W64, kind, bias=bias, what=what)


def test_wgmma_tensor_map_variants_against_reference(rng):
    """The variants that read x through a tensor map (kernels.WgmmaVariant.tma: zeros past M and K from the copy
    itself, weight words put in x's k order per quad): every such shape and PEND, one and two K streams, split K, K
    not a multiple of 64, groups of whole units, of one unit and a half (G % 64 == 32) and one group, a last token
    tile of 5 rows and of 1 row, M of 3 rows, a bias, fp16 and bf16; close to the reference and bitwise the same
    run to run."""
    from awq_cupy.kernels import GEMM_WG_TMA_SHAPES, gemm_wg_pends

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    for K, N, G, kind in ((1000, 200, -1, "float16"), (4096, 1032, 128, "bfloat16"), (768, 96, 96, "float16"),
                          (2112, 264, 64, "bfloat16")):
        Q, Z, S, G = random_layer(rng, K, N, G)
        w = _weight(Q, Z, S, G, kind)
        W64 = kernel_weight(Q, Z, S, G, kind)
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        for shape in GEMM_WG_TMA_SHAPES:
            nb, tw, _ = shape
            tile = 8 * nb
            for pend in gemm_wg_pends(shape):
                for M, splits, ksplit in ((tile + 5, None, 1), (3, 1, 1), (tile - 1, min(3, w.KS), 1),
                                          (tile + 1, 1, 2), (2 * tile, min(3, w.KS), 2), (2 * tile + 1, 2, 1)):
                    if pend is not None and ksplit == 2:
                        continue
                    x = random_x(rng, M, K, kind)
                    run = dict(tiles=tw, splits=splits, bias=bias, wgmma=True, ksplit=ksplit, token_tile=tile,
                               pend=pend)
                    what = f"{shape} PEND={pend} {K}x{N} G={G} M={M} splits={splits} ksplit={ksplit} {kind}"
                    a = _gemm(x, w, tma=True, **run)
                    assert_matmul_close(a, x, W64, kind, bias=bias, what=what)
                    c = _gemm(x, w, tma=True, **run)
                    np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16), err_msg=f"run to run {what}")


def test_wgmma_two_k_streams_against_reference(rng):
    """KW = 2 (two warpgroups on the same channels, each half of a split's units, summed through shared memory):
    every token tile's shape, an odd unit count (the second stream one unit short), a single unit (the second
    stream idle), forced split counts, a bias; close to the reference and bitwise the same run to run."""
    from awq_cupy.kernels import GEMM_WG_KSPLIT_SHAPES

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    for K, N, G, kind in ((960, 520, 64, "float16"), (4096, 1024, 128, "bfloat16"), (64, 136, -1, "float16"),
                          (768, 96, 96, "float16")):
        Q, Z, S, G = random_layer(rng, K, N, G)
        w = _weight(Q, Z, S, G, kind)
        W64 = kernel_weight(Q, Z, S, G, kind)
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        for nb, tw, _ in GEMM_WG_KSPLIT_SHAPES:
            M = 8 * nb - 3
            x = random_x(rng, M, K, kind)
            for splits in (None, 1, min(3, w.KS)):
                what = f"KW=2 shape={(nb, tw)} {K}x{N} G={G} M={M} splits={splits} {kind}"
                a = _gemm(x, w, tw, splits, bias, wgmma=True, ksplit=2)
                assert_matmul_close(a, x, W64, kind, bias=bias, what=what)
                b = _gemm(x, w, tw, splits, bias, wgmma=True, ksplit=2)
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"run to run, {what}")


@pytest.mark.parametrize("K,N,M,tma,tail", [(2048, 2056, 600, False, False), (4608, 3072, 512, True, False),
                                            (4608, 9224, 256, True, True)])
def test_matmul_takes_two_k_streams_where_planned(rng, K, N, M, tma, tail):
    """awq_cupy.matmul on shapes whose plan replaces a split-K by two K streams per CTA: a two-way split by 16 units
    per stream after the x tile pass (plans.wgmma_ksplit; three token tiles, the last partial, N % 16 = 8), and by
    36 units per stream where the 256-token tile reads x through the tensor map (plans._KSPLIT_TMA); a three-way
    split by a wave of two-stream CTAs and a split tail launch (plans._KSPLIT_TMA_TAILS, 132 SMs; N % 16 = 8); a
    bias, fp16 and bf16; close to the reference, and close to the one-stream split-K launch of the same call."""
    import awq_cupy
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    for kind in ("float16", "bfloat16"):
        Q, Z, S, G = random_layer(rng, K, N, 128)
        w = _weight(Q, Z, S, G, kind)
        W64 = kernel_weight(Q, Z, S, G, kind)
        sms = launch.sm_count(w.device)
        args = (M, K, N, G, kind, arch_of_device(w.device), sms, launch._resident(w.device))
        if tail and sms != 132:
            pytest.skip(f"the two-stream tail is planned for this shape on 132 SMs, not {sms}")
        plan, one = plans.plan_gemm_launch(*args), plans.plan_gemm_launch(*args, ksplit=1)
        assert plan.ksplit == 2 and plan.splits == 1 and plan.tma == tma, plan
        assert (plan.tail is not None) == tail and (not tail or plan.tail.splits >= 2), plan
        assert one.splits == (3 if tail else 2) and one.tma == tma, one   # what the two streams replace
        assert not plans.uses_cublas(M, kind, K=K, N=N, sm_count=sms)   # the fused GEMM runs
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        x = random_x(rng, M, K, kind)
        y = awq_cupy.matmul(cp.asarray(x), w, bias=cp.asarray(bias)).get()
        assert_matmul_close(y, x, W64, kind, bias=bias, what=f"matmul, two K streams, {kind}")
        split = _gemm(x, w, None, None, bias, wgmma=True, ksplit=1)
        assert_matmul_close(split, x, W64, kind, bias=bias, what=f"one stream, two splits, {kind}")


def test_explicit_pend_keeps_one_k_stream(rng):
    """A launch that names the wgmma kernel's PEND but not the K streams, on a shape whose plan takes two K streams
    (which exist for the default PEND only), runs the one-stream kernel with that PEND: correct, no missing
    variant."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device
    from awq_cupy.kernels import GEMM_WG_PEND_TWO_PER_SM

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    K, N, M = 2048, 5712, 70
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    W64 = kernel_weight(Q, Z, S, G, "float16")
    sms = launch.sm_count(w.device)
    plan = plans.plan_gemm(M, K, N, G, wgmma=True, sm_count=sms, resident=sms)
    shape = (plan.token_blocks, plan.tiles, plan.depth)
    assert plan.ksplit == 2 and shape in GEMM_WG_PEND_TWO_PER_SM, plan
    x = random_x(rng, M, K, "float16")
    y = cp.full((M, N), np.nan, dtype=cp.float16)
    launch.run_gemm(cp.asarray(x), w, launch.NULL, y, M, "float16", arch_of_device(w.device), sms, False,
                     wgmma=True, pend=GEMM_WG_PEND_TWO_PER_SM[shape])
    assert_matmul_close(y.get(), x, W64, "float16", what="explicit PEND, planned two K streams")


def test_splitk_reduce_columns_per_thread_give_the_same_bits(rng):
    """The split-K reduce kernel's 2-, 4- and 8-column variants add the splits in the same order: bitwise the same
    y for split counts below, at and above the splits one thread requests at once (8, 4, 2), with a bias, an odd
    M and N not a multiple of 16; and close to the reference."""
    from awq_cupy.kernels import REDUCE_COLUMNS

    for K, N, G, kind in ((4096, 136, 128, "float16"), (2048, 520, 64, "bfloat16")):
        Q, Z, S, G = random_layer(rng, K, N, G)
        w = _weight(Q, Z, S, G, kind)
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        for M in (19, 61):
            x = random_x(rng, M, K, kind)
            for splits in (2, 3, 5, 9, 17):
                ys = [_gemm(x, w, 2, splits, bias, reduce_cols=c) for c in REDUCE_COLUMNS]
                what = f"{K}x{N} M={M} splits={splits} {kind}"
                for c, y in zip(REDUCE_COLUMNS[1:], ys[1:]):
                    np.testing.assert_array_equal(y.view(np.uint16), ys[0].view(np.uint16),
                                                  err_msg=f"{c} columns per thread, {what}")
                assert_matmul_close(ys[0], x, kernel_weight(Q, Z, S, G, kind), kind, bias=bias, what=what)


def test_wgmma_two_ctas_per_sm_variants_get_two_ctas_per_sm():
    """On this device, built by its NVRTC, the variants that run two CTAs per SM by design
    (gpu_util.two_per_sm_wgmma_variants) get at least two: the occupancy launch._resident reports, which the split
    planner also reads (the smallest tiles fit three)."""
    from awq_cupy import launch

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    resident = launch._resident(0)
    for kind in ("float16", "bfloat16"):
        for v in two_per_sm_wgmma_variants(kind):
            assert resident(v, v.smem_bytes) >= 2, v.expr


def test_wgmma_two_ctas_per_sm_variant_gives_the_same_bits(rng):
    """The 128-token tile's PEND = 2 variant (plans.wgmma_pend picks it where the grid has more CTAs than SMs) runs
    the same wgmmas in the same order: bitwise the default variant's result, both against the reference."""
    from awq_cupy.kernels import GEMM_WG_PEND_TWO_PER_SM

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    for (nb, tw, depth), pend in GEMM_WG_PEND_TWO_PER_SM.items():
        for K, N, G, kind in ((4096, 4160, 128, "float16"), (1000, 200, -1, "bfloat16"), (768, 96, 96, "float16")):
            Q, Z, S, G = random_layer(rng, K, N, G)
            w = _weight(Q, Z, S, G, kind)
            M = 8 * nb - 5
            x = random_x(rng, M, K, kind)
            for splits in (1, min(3, w.KS)):
                a = _gemm(x, w, tw, splits, wgmma=True)
                b = _gemm(x, w, tw, splits, wgmma=True, pend=pend)
                what = f"PEND={pend} shape={(nb, tw, depth)} {K}x{N} G={G} splits={splits} {kind}"
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=what)
                assert_matmul_close(b, x, kernel_weight(Q, Z, S, G, kind), kind, what=what)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_matmul_where_the_pend_two_grid_fills_two_ctas_per_sm(rng, kind):
    """Layers whose default-PEND grid fits the SMs but whose 128-token PEND 2 plan (more splits, two CTAs per SM,
    at least plans._PEND_TWO_MIN_UNITS units per split) does not (plans.PEND_TWO_OWN_GRID): matmul plans that
    variant and its split-K result matches the reference, with a bias, N % 64 != 0 and M not a multiple of 8, on
    this device's occupancy."""
    from awq_cupy import launch, plans

    if not _has_wgmma():
        pytest.skip("the wgmma GEMM needs compute capability 9.0")
    sms = launch.sm_count(0)
    stream = cp.cuda.get_current_stream().ptr
    seen = 0
    for K, N, M in ((14336, 4096, 128), (14336, 4000, 77), (8960, 4104, 101)):
        Q, Z, S, G = random_layer(rng, K, N, 128)
        w = _weight(Q, Z, S, G, kind)
        plan = launch.prepare_call(w, M, kind, stream).plan
        if getattr(plan, "pend", None) != 2 or not plan.ctas > sms:
            continue
        seen += 1
        bias = (rng.standard_normal(N) * 0.1).astype(np_dtype(kind))
        x = random_x(rng, M, K, kind)
        y = awq_cupy.matmul(cp.asarray(x), w, bias=cp.asarray(bias)).get()
        assert_matmul_close(y, x, kernel_weight(Q, Z, S, G, kind), kind, bias=bias,
                            what=f"{K}x{N} M={M} {kind} {plan}")
    if not seen:
        pytest.skip(f"no such plan on this GPU ({sms} SMs, PEND_TWO_OWN_GRID={plans.PEND_TWO_OWN_GRID})")


# ---------------------------------------------------------------------------------------------------------------
# Streams, graphs, batch invariance
# ---------------------------------------------------------------------------------------------------------------
def test_cuda_graph_capture_and_replay(rng):
    K, N = 4096, 1024
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    for M in (1, 33, 300):
        W64 = either_weight(Q, Z, S, G, "float16")
        x = cp.asarray(random_x(rng, M, K, "float16"))
        y = cp.full((M, N), np.nan, dtype=cp.float16)
        awq_cupy.matmul(x, w, out=y)            # warm-up: compiles and loads outside the capture
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            awq_cupy.matmul(x, w, out=y)
            g = s.end_capture()
        y.fill(np.nan)
        x_new = random_x(rng, M, K, "float16")
        x.set(x_new)
        cp.cuda.get_current_stream().synchronize()   # s does not wait for the null stream's fill and copy
        g.launch(stream=s)
        s.synchronize()
        assert_matmul_close(y.get(), x_new, W64, "float16", what=f"graph replay M={M}")


def test_capture_of_a_launch_shape_not_seen_yet(rng, monkeypatch):
    """Where matmul runs shape-compiled GEMVs (compute capability 9.0), a CUDA graph captured on a weight shape (and
    token count) that has not run yet takes the generic GEMV, already loaded, instead of loading a new module
    during the capture; the replay gives bitwise what the shape-compiled kernel gives afterwards, outside a
    capture."""
    from awq_cupy import launch, plans
    from awq_cupy.jit import arch_of_device

    # no shape-compiled GEMV loaded yet in this process, whatever ran before in it (tests/test_launch.py's
    # test_bound_call_equals_matmul runs the same shape: in one pytest-xdist worker it made this test fail)
    monkeypatch.setattr(launch, "_gemv_shape_kernels", {})
    K, N = 4096, 1104                                   # K x N above the threshold
    if not plans.gemv_specializes(arch_of_device(0), K, N):
        pytest.skip("matmul compiles GEMVs per launch shape on compute capability 9.0 only")
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    warm = _weight(*random_layer(rng, K, 1040, 128)[:3], 128, "float16")
    for M in (1, 16):
        x = cp.asarray(random_x(rng, M, K, "float16"))
        awq_cupy.matmul(x, warm)                      # the generic GEMV family is loaded; w's shape is not
        plan = plans.plan_gemv(M, K, N, G, arch=arch_of_device(0), sm_count=launch.sm_count(0))
        compiled_before = len(launch._gemv_shape_kernels)
        y = cp.full((M, N), np.nan, dtype=cp.float16)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            awq_cupy.matmul(x, w, out=y)
            g = s.end_capture()
        assert len(launch._gemv_shape_kernels) == compiled_before, "a module was loaded during the capture"
        cp.cuda.get_current_stream().synchronize()   # s does not wait for the null stream's fill of y
        g.launch(stream=s)
        s.synchronize()
        eager = awq_cupy.matmul(x, w)                 # now compiled for the shape
        assert len(launch._gemv_shape_kernels) == compiled_before + 1, plan
        np.testing.assert_array_equal(y.get().view(np.uint16), eager.get().view(np.uint16), err_msg=f"M={M}")
        assert_matmul_close(eager.get(), x.get(), either_weight(Q, Z, S, G, "float16"), "float16",
                            what=f"M={M}")


def test_chained_calls_with_programmatic_dependent_launch(rng, monkeypatch):
    """Each call reads the previous call's output directly (GEMV, mma.sync GEMM, wgmma GEMM with split-K): with
    programmatic dependent launch (sm_90) a kernel starts before its predecessor ends and must wait for it before
    reading x or writing y. Results equal the plain launches bit for bit, also replayed from a CUDA graph."""
    from awq_cupy import plans
    from awq_cupy.jit import arch_of_device

    if not plans.uses_pdl(arch_of_device(0)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    K = 2048
    layers = []
    for _ in range(3):
        Q, Z, S, G = random_layer(rng, K, K, 128)
        layers.append((_weight(Q, Z, S, G, "float16"), (Q, Z, S, G)))
    for M in (1, 16, 40, 300):
        x0 = cp.asarray(random_x(rng, M, K, "float16", scale=0.05))
        ys = [cp.full((M, K), np.nan, dtype=cp.float16) for _ in layers]

        def chain():
            for (w, _), y, xin in zip(layers, ys, [x0] + ys[:-1]):
                awq_cupy.matmul(xin, w, out=y)
            return [y.get() for y in ys]

        on = chain()
        monkeypatch.setenv("AWQ_CUPY_PDL", "0")
        settings.reload()
        off = chain()
        monkeypatch.delenv("AWQ_CUPY_PDL")
        settings.reload()
        assert np.isfinite(off[-1]).all()
        for i, (a, b) in enumerate(zip(on, off)):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"layer {i}, M={M}")
        assert_matmul_close(off[0], x0.get(), either_weight(*layers[0][1], "float16"), "float16",
                            what=f"first layer M={M}")
        # captured and replayed: the programmatic edges live in the graph
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            for (w, _), y, xin in zip(layers, ys, [x0] + ys[:-1]):
                awq_cupy.matmul(xin, w, out=y)
            g = s.end_capture()
        for y in ys:
            y.fill(np.nan)
        cp.cuda.get_current_stream().synchronize()   # s does not wait for the null stream's fills
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_array_equal(ys[-1].get().view(np.uint16), off[-1].view(np.uint16),
                                      err_msg=f"graph replay vs plain launches, M={M}")


def test_runs_on_the_callers_stream(rng):
    K, N, M = 4096, 2048, 8
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    x_host = random_x(rng, M, K, "float16")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.asarray(x_host)
        y = awq_cupy.matmul(x, w)
        s.synchronize()
        assert_matmul_close(y.get(), x_host, either_weight(Q, Z, S, G, "float16"), "float16")


def test_batch_invariant_mode(rng):
    K, N = 8192, 1024
    Q, Z, S, G = random_layer(rng, K, N, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = cp.asarray(random_x(rng, 300, K, "float16"))
    ref_rows = awq_cupy.matmul(x[:1], w, batch_invariant=True).get()
    for M in (2, 17, 64, 300):
        y = awq_cupy.matmul(x[:M], w, batch_invariant=True).get()
        np.testing.assert_array_equal(y[:1].view(np.uint16), ref_rows.view(np.uint16), err_msg=f"M={M}")


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------
def test_bad_input_errors(rng):
    Q, Z, S, G = random_layer(rng, 256, 128, 128)
    w = _weight(Q, Z, S, G, "float16")
    x = random_x(rng, 4, 256, "float16")
    with pytest.raises(TypeError, match="cupy.ndarray"):
        awq_cupy.matmul(x, w)
    with pytest.raises(TypeError, match="float32"):
        awq_cupy.matmul(cp.asarray(x.astype(np.float32)), w)
    with pytest.raises(ValueError, match="K=256"):
        awq_cupy.matmul(cp.asarray(x[:, :128]), w)
    with pytest.raises(TypeError, match="astype"):
        awq_cupy.matmul(cp.asarray(x.astype(np_dtype("bfloat16"))), w)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        awq_cupy.matmul(cp.asarray(x), cp.zeros((256, 128), cp.float16))
    with pytest.raises(ValueError, match="bias"):
        awq_cupy.matmul(cp.asarray(x), w, bias=cp.zeros(64, cp.float16))
    with pytest.raises(ValueError, match="group_size=48"):
        awq_cupy.QuantizedWeight.from_gemm(*[formats.pack(Q[:96], Z[:2], S[:2], "gemm", 48)[k]
                                             for k in ("qweight", "qzeros", "scales")], 48)
    xg = cp.asarray(x)
    with pytest.raises(ValueError, match="overlap"):
        awq_cupy.matmul(xg, w, out=xg.reshape(-1)[:512].reshape(4, 128))
    other = cp.cuda.runtime.getDeviceCount() > 1
    if other:
        with cp.cuda.Device(1):
            x1 = cp.asarray(x)
        with pytest.raises(ValueError, match="GPU"):
            awq_cupy.matmul(x1, w)


def test_non_contiguous_x_is_copied_and_m0_is_empty(rng):
    Q, Z, S, G = random_layer(rng, 256, 128, 128)
    w = _weight(Q, Z, S, G, "float16")
    big = random_x(rng, 8, 512, "float16")
    x = cp.asarray(big)[:, ::2]                 # strided view
    assert not x.flags.c_contiguous
    y = awq_cupy.matmul(x, w).get()
    assert_matmul_close(y, big[:, ::2], either_weight(Q, Z, S, G, "float16"), "float16")
    e = awq_cupy.matmul(cp.zeros((0, 256), cp.float16), w)
    assert e.shape == (0, 128)
