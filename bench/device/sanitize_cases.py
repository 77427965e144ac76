"""Small, odd-shaped calls of every kernel, for compute-sanitizer (memcheck / racecheck) on the GPU machine:

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 bench/device/sanitize_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/device/sanitize_cases.py
    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 bench/device/sanitize_cases.py pair_tail   # one case
"""
import itertools
import sys

import numpy as np
import cupy as cp

import awq_cupy
from awq_cupy import formats, kernels, launch, plans
from awq_cupy.jit import arch_of_device
from awq_cupy.kernels import GEMM_SHAPES, GEMM_WG_SHAPES

rng = np.random.default_rng(0)
ONLY = sys.argv[1:]   # "pair_tail": that case alone (a quick check of the newest launch shape)


def gemm_tensors(K, N, G):
    """A random layer as AutoAWQ gemm-packed device tensors (qweight, qzeros, scales)."""
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (K // G, N), dtype=np.uint8)
    S = rng.uniform(0.01, 0.02, (K // G, N)).astype(np.float16)
    return {k: cp.asarray(v) for k, v in formats.pack(Q, Z, S, "gemm", G).items()}


def pair_tail():
    """The wgmma GEMM at two CTAs per SM (the 128-token tile's PEND 2) as matmul plans it: one wave of pairs (264
    column tiles), then the other 25 split K ways in a tail launch (plans.PAIR_TAILS on for it); a partial token
    tile, N % 16 = 8. The shape of test_matmul_pair_grid_tail_against_reference: at K = 1024, N = 34824 (9 tiles
    past the wave) the model keeps the one launch, the second launch's start costing more than a lone round saves."""
    was, plans.PAIR_TAILS = plans.PAIR_TAILS, True
    try:
        K, N = 4096, 36872
        t = gemm_tensors(K, N, 128)
        for kind in ("float16", "bfloat16"):
            w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], 128, dtype=kind)
            dt = np.float16 if kind == "float16" else awq_cupy.dtypes.numpy_dtype("bfloat16")
            pc = launch.prepare_call(w, 100, kind, cp.cuda.get_current_stream().ptr)
            assert pc.plan.pend is not None and pc.plan.tail is not None, pc.plan
            x = cp.asarray(rng.standard_normal((100, K)).astype(np.float32).astype(dt))
            awq_cupy.matmul(x, w, bias=cp.asarray(rng.standard_normal(N).astype(np.float32).astype(dt)))
    finally:
        plans.PAIR_TAILS = was


if ONLY:
    if ONLY != ["pair_tail"]:
        raise SystemExit(f"sanitize_cases.py {' '.join(ONLY)}: the one case that runs alone is pair_tail")
    if not plans.has_wgmma(arch_of_device(0)):
        raise SystemExit("pair_tail: the wgmma GEMM needs compute capability 9.0")
    pair_tail()
    print("sanitize cases done: pair_tail")
    raise SystemExit(0)

for K, N, G, kinds in [(24, 8, -1, ("float16", "bfloat16")), (96, 72, 32, ("float16", "bfloat16")),
                       (328, 136, -1, ("float16",)), (1024, 520, 128, ("float16", "bfloat16")),
                       (768, 4160, 96, ("float16",))]:
    G = formats.resolve_group_size(G, K)
    t = gemm_tensors(K, N, G)
    for kind in kinds:
        awq_cupy.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind)
        w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind)
        awq_cupy.dequantize(w)
        dt = np.float16 if kind == "float16" else awq_cupy.dtypes.numpy_dtype("bfloat16")
        for M in (1, 3, 9, 16, 17, 33, 70, 130, 260):
            x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32)).astype(cp.float16)
            if kind == "bfloat16":
                x = cp.asarray(x.get().astype(np.float32).astype(dt))
            bias = cp.asarray(rng.standard_normal(N).astype(np.float32).astype(dt))
            if not plans.uses_cublas(M, kind):   # cuBLAS's own kernels are not ours to check (racecheck flags them)
                awq_cupy.matmul(x, w, bias=bias)
            awq_cupy.matmul(x, w, batch_invariant=True)
            if M <= 16:   # every GEMV variant, whatever the dispatch table picks
                for tiles in (1, 2, 3, 4):
                    y = cp.empty((M, N), dtype=x.dtype)
                    awq_cupy.launch.run_gemv(x, w, bias, y, M, kind, awq_cupy.launch.sm_count(w.device), tiles=tiles)
                if plans.aligned_groups(G, K // G):   # pairs with two 64-k blocks per unit
                    y = cp.empty((M, N), dtype=x.dtype)
                    awq_cupy.launch.run_gemv(x, w, bias, y, M, kind, awq_cupy.launch.sm_count(w.device), tiles=2,
                                              kdepth=2)
            for wg in sorted({False, plans.has_wgmma(arch_of_device(w.device))}) if M > 8 else ():
                for nb, tw, depth in (GEMM_WG_SHAPES if wg else GEMM_SHAPES):  # every GEMM variant of M's tile
                    if plans.gemm_token_tile(M, wg) == 8 * nb:
                        pends = kernels.gemm_wg_pends((nb, tw, depth)) if wg else (None,)
                        tmas = (False, True) if wg and kernels.has_tma((nb, tw, depth)) else (None,)
                        for splits, pend, xt in itertools.product((1, min(3, w.KS)), pends, tmas):
                            y = cp.empty((M, N), dtype=x.dtype)
                            launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device),
                                             launch.sm_count(w.device), False, tiles=tw, splits=splits, wgmma=wg,
                                             depth=depth, pend=pend, tma=xt)
            if plans.gemm_token_tile(M, True) >= 128 and plans.has_wgmma(arch_of_device(w.device)):   # 2 K streams
                for splits, xt in itertools.product((1, min(3, w.KS)), (False, True)):
                    y = cp.empty((M, N), dtype=x.dtype)
                    launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device), launch.sm_count(w.device),
                                     False, splits=splits, wgmma=True, ksplit=2, tma=xt)
            for cols in kernels.REDUCE_COLUMNS if M > 8 else ():   # the split-K reduce's 2, 4, 8 columns per thread
                y = cp.empty((M, N), dtype=x.dtype)
                launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device), launch.sm_count(w.device), False,
                                 splits=min(5, w.KS), wgmma=False, reduce_cols=cols)
# The wgmma GEMM with a split tail launch (plans.TailSplit): more column tiles than a wave of 256-token CTAs, the
# last tile 8 columns wide, the last token tile partial; with one K stream and with two (64-channel column tiles)
if plans.has_wgmma(arch_of_device(0)):
    for K, N, G in [(1032, 17416, -1), (2048, 18824, 64)]:
        t = gemm_tensors(K, N, formats.resolve_group_size(G, K))
        for kind in ("float16", "bfloat16"):
            w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"],
                                                   formats.resolve_group_size(G, K), dtype=kind)
            dt = np.float16 if kind == "float16" else awq_cupy.dtypes.numpy_dtype("bfloat16")
            bias = cp.asarray(rng.standard_normal(N).astype(np.float32).astype(dt))
            for M in (257, 300):
                x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dt))
                # after the x tile pass, and x through a tensor map
                for xt, ksplit in itertools.product((False, True), (1, 2)):
                    y = cp.empty((M, N), dtype=x.dtype)
                    launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device), launch.sm_count(w.device),
                                     False, wgmma=True, tail=True, tma=xt, ksplit=ksplit)
if plans.has_wgmma(arch_of_device(0)):
    pair_tail()
# Every wgmma GEMM shape over three token tiles, the last 5 rows (its token tile forced), and matmul's row split
# (plans.RowSplit: whole 256-token tiles, then the rest as its own call: the GEMV for 1 and 8 rows, a 64-token tile
# for 44), N % 16 = 8, with a bias
if plans.has_wgmma(arch_of_device(0)):
    for K, N, G, Ms, forced in [(1024, 520, 128, (), True), (1024, 16392, 128, (257, 300, 520), False)]:
        t = gemm_tensors(K, N, G)
        for kind in ("float16", "bfloat16"):
            w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind)
            dt = np.float16 if kind == "float16" else awq_cupy.dtypes.numpy_dtype("bfloat16")
            bias = cp.asarray(rng.standard_normal(N).astype(np.float32).astype(dt))
            for nb, tw, depth in GEMM_WG_SHAPES if forced else ():
                M = 16 * nb + 5
                x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dt))
                y = cp.empty((M, N), dtype=x.dtype)
                for xt in (False, True) if kernels.has_tma((nb, tw, depth)) else (None,):
                    launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device), launch.sm_count(w.device),
                                     False, tiles=tw, depth=depth, wgmma=True, token_tile=8 * nb, tma=xt)
                # the x-producer variants (off in the plans), one and two K streams, split and not
                xp_runs = itertools.product((1, 2), (1, 3)) if kernels.has_producers((nb, tw, depth)) else ()
                for ksplit, splits in xp_runs:
                    launch.run_gemm(x, w, bias, y, M, kind, arch_of_device(w.device), launch.sm_count(w.device),
                                     False, tiles=tw, depth=depth, wgmma=True, token_tile=8 * nb, producers=True,
                                     ksplit=ksplit, splits=splits)
            for M in Ms:
                pc = launch.prepare_call(w, M, kind, cp.cuda.get_current_stream().ptr)
                assert isinstance(pc.plan, plans.RowSplit), (M, pc.plan)
                x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dt))
                awq_cupy.matmul(x, w, bias=bias)
# The GEMV's three- and four-token-block variants (sm_90, groups of whole 64-k blocks: 17..32 rows), every one,
# at odd shapes (K not a multiple of 64, one group, N not a multiple of 64, one block per CTA) and two warp counts
for K, N, G in [(328, 136, -1), (1024, 520, 128), (1088, 4232, 64)]:
    G = formats.resolve_group_size(G, K)
    t = gemm_tensors(K, N, G)
    for kind in ("float16", "bfloat16"):
        w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind)
        dt = np.float16 if kind == "float16" else awq_cupy.dtypes.numpy_dtype("bfloat16")
        bias = cp.asarray(rng.standard_normal(N).astype(np.float32).astype(dt))
        for nb, tiles in kernels.gemv_wide_shapes(arch_of_device(0)):
            for M, warps in itertools.product((8 * nb - 7, 8 * nb), (None, 3)):
                x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dt))
                y = cp.empty((M, N), dtype=x.dtype)
                launch.run_gemv(x, w, bias, y, M, kind, launch.sm_count(0), tiles=tiles, warps=warps)
# GEMV CTAs of 6 and 7 column blocks: short last column groups with 2, 3 and 4 blocks per unit, warps' runs that
# end inside and across groups (K = 1088: 17 units per block; G = 32: two groups per unit)
sms = launch.sm_count(0)
for G in (64, 32):
    K, N = 1088, 16 * (6 * sms + sms // 2)
    t = gemm_tensors(K, N, G)
    w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype="float16")
    for M, tiles, warps in itertools.product((1, 16), (2, 3, 4), (None, 2)):
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        y = cp.empty((M, N), dtype=x.dtype)
        launch.run_gemv(x, w, launch.NULL, y, M, "float16", sms, tiles=tiles, warps=warps)
    if G == 64:   # pairs with two 64-k blocks per unit: 17 blocks, the last unit's second one past K
        for M, warps in itertools.product((1, 16), (None, 2)):
            x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
            y = cp.empty((M, N), dtype=x.dtype)
            launch.run_gemv(x, w, launch.NULL, y, M, "float16", sms, tiles=2, warps=warps, kdepth=2)
# GEMVs compiled for their launch shape (what matmul runs on compute capability 9.0 for model-sized weights; the
# CTAs of 6 and 7 blocks above already are; at M = 1 and 16 for that token count too, M = 1 here at every size), at
# small odd shapes, for several variants and warp counts
plans.GEMV_M1_MIN_WEIGHTS = 0
arch = arch_of_device(0)
for K, N, G in [(96, 72, 32), (328, 136, -1), (1024, 520, 128)]:
    G = formats.resolve_group_size(G, K)
    t = gemm_tensors(K, N, G)
    w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype="float16")
    bias = cp.asarray(rng.standard_normal(N).astype(np.float16))
    for M in (1, 9, 16, 24, 32):
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        for tiles, kdepth, warps in ((None, None, None), (1, None, 3), (3, None, None), (4, None, 2), (2, 2, None)):
            if kdepth == 2 and not plans.aligned_groups(G, K // G):
                continue
            if M > 16 and (kdepth or tiles in (1, 4) or not plans.aligned_groups(G, K // G) or not arch.gemv_wide):
                continue   # three and four token blocks: the planned variant and threes
            p = plans.plan_gemv(M, K, N, G, arch=arch, sm_count=sms, tiles=tiles, kdepth=kdepth, warps=warps)
            y = cp.empty((M, N), dtype=x.dtype)
            launch.gemv_kernel(w, p, "float16", arch, M, specialize=True).launch(
                (p.grid,), (32 * p.warps,), launch.gemv_args(x, w, bias, y, M, p), smem=p.smem,
                pdl=plans.uses_pdl(arch))
cp.cuda.Device().synchronize()
print("sanitize cases done")
