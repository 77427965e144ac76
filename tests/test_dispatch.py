"""Launch planning and the dispatch table, on the CPU (no device is touched)."""
import math

import pytest

from awq_cupy import dispatch, jit, kernels, plans
from awq_cupy import settings
from awq_cupy.plans import fastdiv, gemm_shape_for, gemv_dividers, plan_gemm, plan_gemv, plan_splits, rounds_weights, uses_cublas
from awq_cupy.launch import gemv_args


def _fd(n, d):
    """floor(n / d) the way the GEMV computes it (common.cuh fastdiv with plans.fastdiv's parameter)."""
    f = int(fastdiv(d))
    return (n * (f & 0xFFFFFFFF)) >> (f >> 32)


def _simulate_gemv_split(NT16, KS, grid, W, TW, KD=1, one_slot=False):
    """Python model of kernels_cu/gemv_tc.cu's work split: returns {16-column block: [64-k blocks summed, in
    order]} from the direct stores and the partial-sum reduction, following the kernel's own index arithmetic
    (units of KD 64-k blocks, KQ = ceil(KS / KD) per column group; a unit's blocks past KS hold nothing).
    ``one_slot``: awq_gemv::OneSlot's scheme (one partial slot per warp; the warp where a group starts keeps its
    own last segment), else two slots per warp (first and last segment)."""
    out = {}

    def put(b0, nblk, cg, seg):
        for i in range(TW):
            if TW * cg + i < nblk:
                assert b0 + TW * cg + i not in out, "a block stored twice"
                out[b0 + TW * cg + i] = list(seg)

    KQ = -(-KS // KD)

    for b in range(grid):
        b0 = _fd(b * NT16, grid)
        nblk = _fd((b + 1) * NT16, grid) - b0
        units = -(-nblk // TW) * KQ
        U = _fd(units + W - 1, W) if units else 1
        slots, kept, runs = {}, {}, []
        for w in range(W):
            u0 = min(units, w * U)
            u1 = min(units, u0 + U)
            runs.append((u0, u1))
            c_cg = _fd(u0, KQ)
            c_ks = KD * (u0 - KQ * c_cg)
            seg_first, whole_start, seg = True, c_ks == 0, []
            for it in range(u1 - u0):
                seg += [c_ks + d for d in range(KD) if c_ks + d < KS]
                if c_ks + KD >= KS or it + 1 == u1 - u0:
                    c_ks = min(KS, c_ks + KD)
                    if whole_start and c_ks == KS:
                        put(b0, nblk, c_cg, seg)
                    elif one_slot and whole_start:   # starts its group, ends the run: kept for this warp's sum
                        assert it + 1 == u1 - u0, "a kept segment before the run's end"
                        kept[w] = (c_cg, list(seg))
                    else:
                        slot = w if one_slot else 2 * w if seg_first else 2 * w + 1
                        assert slot not in slots, "a partial slot written twice"
                        slots[slot] = (c_cg, list(seg))
                    seg, seg_first, whole_start = [], False, True
                    if c_ks == KS:
                        c_ks, c_cg = 0, c_cg + 1
                else:
                    c_ks += KD
        for w, (u0, u1) in enumerate(runs):
            if u1 == u0:
                continue
            tl = _fd(u1 - 1, KQ)
            if tl * KQ >= u0 and (tl + 1) * KQ > u1:
                w_hi = ((tl + 1) * KQ - 1) // U
                first = 2 * w if tl * KQ == u0 else 2 * w + 1
                summed = []
                for w2 in range(w, w_hi + 1):
                    if one_slot:
                        cg, seg = kept.pop(w) if w2 == w else slots.pop(w2)
                    else:
                        cg, seg = slots.pop(first if w2 == w else 2 * w2)
                    assert cg == tl, "a partial of another column group"
                    summed += seg
                put(b0, nblk, tl, summed)
        assert not slots and not kept, "partials nobody reduced"
    return out


def test_fastdiv_is_exact_below_2_31():
    """The GEMV divides by launch constants (grid, warps, 64-k blocks, group size) as (n * m) >> s: exact for every
    numerator below 2^31, for any divisor, including powers of two, 1 and the largest."""
    import numpy as np

    rng = np.random.default_rng(3)
    divisors = list(range(1, 300)) + [1023, 1024, 1025, 4095, 4096, 2**20 + 7, 2**30 - 1, 2**30, 2**31 - 1] + \
        [int(d) for d in rng.integers(1, 2**31 - 1, 100)]
    ns = np.concatenate([np.arange(5000), rng.integers(0, 2**31, 20000), [2**31 - 2, 2**31 - 1]]).astype(np.uint64)
    for d in divisors:
        f = int(fastdiv(d))
        q = (ns * np.uint64(f & 0xFFFFFFFF)) >> np.uint64(f >> 32)
        edges = np.array([d - 1, d, d + 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1], dtype=np.uint64)
        qe = (edges * np.uint64(f & 0xFFFFFFFF)) >> np.uint64(f >> 32)
        assert (q == ns // np.uint64(d)).all() and (qe == edges // np.uint64(d)).all(), d
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            fastdiv(bad)


def test_gemv_dividers_check_the_index_range():
    p = plan_gemv(1, 4096, 4096, 128)
    got = gemv_dividers(p.grid, p.NT16, p.warps, 64, 128)
    assert [int(v) for v in got] == [int(fastdiv(d)) for d in (p.grid, p.warps, 64, 128)]
    with pytest.raises(ValueError, match="32-bit index"):
        gemv_dividers(p.grid, 2**31 // p.grid, p.warps, 64, 128)
    with pytest.raises(ValueError, match="32-bit index"):
        gemv_dividers(p.grid, p.NT16, p.warps, 2**25, 128)


@pytest.mark.parametrize("NT16,KS", [(448, 64), (64, 64), (96, 64), (256, 224), (4, 1), (16, 64), (12, 3),
                                     (4, 100), (12, 5), (200, 1), (1792, 64), (36, 7), (260, 6)])
@pytest.mark.parametrize("W", [16, 12, 4])
@pytest.mark.parametrize("TW,KD,one_slot", [(1, 1, False), (2, 1, False), (3, 1, False), (4, 1, False), (2, 2, False),
                                             (3, 1, True), (4, 1, True)])
def test_gemv_split_sums_every_unit_once(NT16, KS, W, TW, KD, one_slot):
    grid = max(1, min(NT16, 132))
    out = _simulate_gemv_split(NT16, KS, grid, W, TW, KD, one_slot)
    assert sorted(out) == list(range(NT16)), "every 16-column block is written exactly once"
    for t, seg in out.items():
        assert seg == list(range(KS)), f"block {t}: each 64-k unit once, in k order"


@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16, 17, 24, 25, 32])
@pytest.mark.parametrize("arch", list(jit.ARCHS))
def test_gemv_plan_fits_the_arch(M, arch):
    a = jit.ARCHS[arch]
    for K, N, G in [(4096, 28672, 128), (14336, 4096, 32), (64, 64, 64), (28672, 8192, 128)]:
        shapes = kernels.gemv_shapes(a, G % 64 == 0 or K // G == 1)
        if M > 16 and (not a.gemv_wide or G % 64):
            assert not any(nb == -(-M // 8) for nb, _ in shapes)
            with pytest.raises(ValueError, match="no GEMV variant"):
                plan_gemv(M, K, N, G, arch=a)
        for nb, tiles in shapes:
            if nb != -(-M // 8):
                continue
            p = plan_gemv(M, K, N, G, arch=a, tiles=tiles)
            assert p.smem <= a.smem_optin
            assert 1 <= p.warps <= kernels.GemvVariant("float16", nb, tiles, p.aligned).max_warps(a)
            assert p.grid <= 132 and p.grid <= p.NT16 and p.NT16 * 16 >= N
            assert p.aligned == (G % 64 == 0 or K // G == 1)


def test_gemv_two_k_blocks_per_unit_where_the_h200_measured_them_faster():
    """The pair variant with two 64-k blocks per unit (bench/results/h200_gemv_sweep_v29.txt, h200_gemv_kd2_v29.txt):
    chosen for Mistral-7B o and down (two blocks per CTA) up to 8 tokens (fp16), where it ties with pairs at M = 1
    and is faster at 8, and with bf16 activations for gate_up too (14 blocks per CTA: 0-0.1 us ahead of threes in
    two sweeps, h200_gemv_sweep_v37_bf16_m1.txt); not where threes or fours were faster, nor for groups that split
    a 64-k block, nor from 9 tokens, where the plain pairs (scaled weights, 16 warps) are faster
    (h200_gemv_sweep_v36_m16.txt)."""
    from awq_cupy.bench import MODELS

    kd2 = {("mistral-7b", 1): {"o", "down"}, ("mistral-7b", 16): set(),
           ("llama-2-70b", 1): set(), ("llama-2-70b", 16): set()}
    for (model, M), want in kd2.items():
        for m in (M, 8) if M == 1 else (M, 9):
            got = {name for name, K, N in MODELS[model] if plan_gemv(m, K, N, 128).kdepth == 2}
            assert got == want, (model, m, got)
    bf16 = {m: {n for n, K, N in MODELS["mistral-7b"] if plan_gemv(m, K, N, 128, dtype="bfloat16").kdepth == 2}
            for m in (1, 8, 9, 16)}
    assert bf16 == {1: {"o", "gate_up", "down"}, 8: {"o", "gate_up", "down"}, 9: set(), 16: set()}
    assert {n for n, K, N in MODELS["llama-2-70b"] if plan_gemv(1, K, N, 128, dtype="bfloat16").kdepth == 2} == set()
    for m in (9, 16):   # the scaled pairs at 16 warps instead
        for dt in ("float16", "bfloat16"):
            p = plan_gemv(m, 14336, 4096, 128, dtype=dt)
            assert (p.tiles, p.kdepth, p.warps) == (2, 1, 16), (m, dt, p)
    for name, K, N in MODELS["mistral-7b"]:
        p = plan_gemv(1, K, N, 128)
        assert p.tiles == (3 if name in ("qkv", "gate_up") else 2), name
        assert plan_gemv(1, K, N, 32).kdepth == 1           # two groups per 64-k block
        assert plan_gemv(1, K, N, 128, tiles=2).kdepth == 1  # explicit tiles: the plain variant
    assert plan_gemv(1, 64, 64, 64).tiles == 1               # one block per CTA
    with pytest.raises(ValueError, match="kdepth"):
        plan_gemv(1, 4096, 4096, 128, tiles=3, kdepth=2)
    with pytest.raises(ValueError, match="kdepth"):
        plan_gemv(1, 4096, 4096, 32, tiles=2, kdepth=2)
    with pytest.raises(ValueError, match="kdepth"):
        plan_gemv(1, 4096, 4096, 128, tiles=2, kdepth=3)
    assert plan_gemv(1, 4096, 4096, 4096, tiles=2, kdepth=2).kdepth == 2   # one group of K
    assert plan_gemv(16, 4096, 4096, 128, tiles=2, kdepth=2).warps == 8
    assert plan_gemv(1, 4096, 28672, 128, kdepth=2).tiles == 2     # kdepth 2 alone: pairs
    assert plan_gemv(1, 4096, 28672, 128, kdepth=1).tiles == 3     # kdepth 1 alone: the slot rule's tiles


def test_gemv_scaled_pairs_and_their_warps():
    """The pairs at two token blocks (and only they) decode scaled weights (kernels_cu/gemv_tc.cu awq_gemv::Scaled),
    which gives them 16 warps on sm_90 (128 registers, no spill) and keeps the other archs' bounds."""
    from awq_cupy.jit import ARCHS

    V = kernels.GemvVariant
    scaled = {(nb, tw, kd) for nb, tw in kernels.GEMV_SHAPES for kd in (1, 2) if V("float16", nb, tw, True, kd).scaled}
    assert scaled == {(2, 2, 1)}
    assert V("float16", 2, 2).max_warps(ARCHS["90"]) == 16 and V("float16", 2, 2, False).max_warps(ARCHS["90"]) == 16
    assert V("float16", 2, 2).max_warps(ARCHS["89"]) == 12 and V("float16", 2, 2).max_warps(ARCHS["75"]) == 8
    assert V("float16", 2, 2, True, 2).max_warps(ARCHS["90"]) == 8
    assert plan_gemv(16, 4096, 4096, 32).warps == 16    # also with two scale groups per 64-k block


def test_gemv_one_partial_slot_per_warp_where_the_kernel_keeps_one():
    """awq_gemv::OneSlot (two token blocks, three or four blocks per unit) keeps one fp32 partial slot per warp;
    plan_gemv's shared memory follows it (the kernel's own size, awq_gemv::smem_bytes, is checked against
    kernels.GemvVariant.smem_bytes by the family's static_asserts when it compiles)."""
    one = {(nb, tw) for nb, tw in kernels.GEMV_SHAPES if kernels.GemvVariant("float16", nb, tw).one_slot}
    assert one == {(2, 3), (2, 4)}
    for M, K, N in [(16, 4096, 28672), (16, 14336, 4096), (1, 4096, 28672), (12, 8192, 57344)]:
        p = plan_gemv(M, K, N, 128)
        slots = 1 if p.variant("float16").one_slot else 2
        assert p.smem == slots * p.warps * 32 * p.tiles * p.token_blocks * 16, (M, K, N, p)


def _wide_sweep():
    """{(model, dtype, layer, K, N, M): {path: us}} of bench/results/h200_gemv_wide_sweep_v40.txt."""
    from pathlib import Path

    rows = {}
    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "h200_gemv_wide_sweep_v40.txt"
    for line in path.read_text().splitlines():
        if line.startswith("ROW "):
            _, model, dt, layer, K, N, M, what, us = line.split()
            rows.setdefault((model, dt, layer, int(K), int(N), int(M)), {})[what] = float(us)
    return rows


def test_gemv_wide_rule_and_tiles_match_the_h200_sweep():
    """gemv_wide_takes gives each swept layer row (Mistral-7B M = 17..32 fp16, 17, 24, 32 bf16; Llama-2-70B 17,
    24, 32 fp16 and bf16) to the path that measured faster: the GEMV's planned variant against matmul's GEMM.
    Where it takes the GEMV, the slot times pick the fastest variant measured but on three rows, at most 0.26 us
    behind."""
    from awq_cupy.plans import gemv_wide_takes

    rows = _wide_sweep()
    assert len(rows) == 56 and {k[:2] for k in rows} == {(m, d) for m in ("mistral-7b", "llama-2-70b")
                                                         for d in ("float16", "bfloat16")}
    behind = []
    for (model, dt, layer, K, N, M), t in rows.items():
        p = plan_gemv(M, K, N, 128, dtype=dt)
        assert p.warps == p.variant(dt).max_warps(jit.ARCHS["90"])
        gemv = t[f"gemv:{p.token_blocks}:{p.tiles}:{p.warps}"]
        takes = gemv_wide_takes(M, K, N, 128, jit.ARCHS["90"], dtype=dt)
        assert takes == (gemv < t["gemm"]), (model, dt, layer, M, gemv, t["gemm"])
        if takes:
            best = min(v for k, v in t.items() if k.startswith("gemv:"))
            if gemv > best:
                behind.append(round(gemv - best, 2))
    assert sorted(behind) == [0.05, 0.05, 0.26]      # two ties; bf16 Mistral-7B o at M = 24 (8.86 against 8.60)


def test_gemv_wide_rule_limits(tmp_path, monkeypatch):
    """The GEMV beyond 16 rows only on sm_90, for groups of whole 64-k blocks, on layers with more 16-column blocks
    than CTAs, up to the dispatch row's gemv_wide_max_m, and never inside a batch-invariant matmul (rounds_weights
    above)."""
    from awq_cupy.plans import gemv_wide_takes

    a = jit.ARCHS["90"]
    assert gemv_wide_takes(17, 4096, 4096, 128, a) and gemv_wide_takes(32, 4096, 4096, 128, a)
    assert not gemv_wide_takes(16, 4096, 4096, 128, a) and not gemv_wide_takes(33, 4096, 4096, 128, a)
    assert not gemv_wide_takes(24, 4096, 4096, 32, a)                  # two groups per 64-k block
    assert not gemv_wide_takes(24, 4096, 4096, 128, jit.ARCHS["89"])
    assert not gemv_wide_takes(24, 4096, 1024, 128, a)                 # one block per CTA: not measured
    assert not gemv_wide_takes(24, 4096, 4096, 128, a, sm_count=300)   # 256 blocks: one per CTA
    path = tmp_path / "dispatch.json"
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, wgmma_min_m=17,
                                                         gemv_wide_max_m=24)}, {})
    assert gemv_wide_takes(24, 4096, 4096, 128, a) and not gemv_wide_takes(25, 4096, 4096, 128, a)
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, wgmma_min_m=17)}, {})
    assert not gemv_wide_takes(24, 4096, 4096, 128, a)                 # gemv_wide_max_m 0: never
    for bad in (16, 33, 1, True, "24"):
        with pytest.raises(ValueError, match="gemv_wide_max_m"):
            dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, gemv_wide_max_m=bad)
    with pytest.raises(ValueError, match="below cublas_min_m=24"):
        dispatch.Dispatch(gemv_max_m=16, cublas_min_m=24, gemv_wide_max_m=24)
    dispatch.reload()


def test_gemv_plan_rejects_bad_m():
    for M in (0, 33):
        with pytest.raises(ValueError, match="no GEMV variant"):
            plan_gemv(M, 64, 64, 64)
    with pytest.raises(ValueError, match="more than 16 rows need an arch with the wide GEMV"):
        plan_gemv(17, 4096, 4096, 128, arch=jit.ARCHS["89"])
    with pytest.raises(ValueError, match="groups of whole 64-k blocks"):
        plan_gemv(32, 4096, 4096, 32)
    assert plan_gemv(17, 64, 64, 64).tiles == 2      # one block per CTA: the pairs (no (3, 1) variant)
    with pytest.raises(ValueError, match="tiles=1 is not a GEMV variant"):
        plan_gemv(17, 64, 64, 64, tiles=1)
    with pytest.raises(ValueError, match="tiles=4 is not a GEMV variant"):
        plan_gemv(25, 4096, 4096, 128, tiles=4)
    with pytest.raises(ValueError, match="tiles"):
        plan_gemv(1, 64, 64, 64, tiles=5)
    with pytest.raises(ValueError, match="tiles"):
        plan_gemv(9, 64, 64, 64, tiles=8)
    with pytest.raises(ValueError, match="warps"):
        plan_gemv(1, 64, 64, 64, tiles=4, warps=16)
    with pytest.raises(ValueError, match="warps"):
        plan_gemv(9, 64, 64, 64, tiles=4, warps=12)   # two token blocks x four blocks: 8 warps
    assert plan_gemv(1, 4096, 4096, 128, tiles=3).warps == 16
    assert plan_gemv(1, 4096, 4096, 32, tiles=3).warps == 12   # two scale groups per unit: 12 warps
    with pytest.raises(ValueError, match="warps"):
        plan_gemv(1, 4096, 4096, 32, tiles=3, warps=16)


def test_gemv_tiles_choice():
    from awq_cupy.plans import gemv_tiles_for

    # the fastest variant measured per layer on the H200 (bench/sweeps/gemv_sweep.py, docs/history.md v29):
    # (NT16, tiles) for Mistral-7B o/down (2 blocks per CTA), qkv (3), gate_up (14), Llama-2-70B o/down (4), qkv (5),
    # gate_up (28)
    up_to_8 = ((256, 2), (384, 3), (1792, 3), (512, 4), (640, 3), (3584, 4))
    up_to_16 = ((256, 2), (384, 3), (1792, 3), (512, 4), (640, 3), (3584, 4))
    for M, table in ((1, up_to_8), (8, up_to_8), (9, up_to_16), (16, up_to_16)):
        for NT16, tiles in table:
            assert gemv_tiles_for(M, NT16, 132) == tiles, (M, NT16)
    # bf16 at two token blocks (Mistral-7B measured, h200_gemv_sweep_v36_m16.txt): the same choices as fp16; the v29
    # sweep had (2, 3) slower than fours at 3 and 14 blocks per CTA, the v36 one faster
    for NT16, tiles in up_to_16:
        assert gemv_tiles_for(16, NT16, 132, "bfloat16") == tiles, NT16
    assert gemv_tiles_for(1, 384, 132, "bfloat16") == 3
    assert gemv_tiles_for(1, 1792, 132, "bfloat16") == 3
    assert plan_gemv(16, 4096, 6144, 128, dtype="bfloat16").tiles == 3
    assert plan_gemv(16, 4096, 6144, 128).tiles == 3
    assert gemv_tiles_for(1, 4, 4) == 1          # one block per CTA
    assert gemv_tiles_for(16, 132, 132) == 1
    assert gemv_tiles_for(16, 132 * 12, 132) == 4
    # a tie goes to the larger unit
    assert gemv_tiles_for(16, 132 * 12, 132, slot={4: 1.0, 3: 1.0, 2: 1.5}) == 4
    assert gemv_tiles_for(1, 1792, 132, slot={2: 1.0, 4: 1.2}) == 2      # a table may leave variants out


# The H200 sweeps (us, the fastest warp count of each variant, "2x2": pairs with two 64-k blocks per unit): (blocks
# per CTA, {tiles: us}) for Mistral-7B qkv, o, gate_up, down and Llama-2-70B qkv, o, gate_up, down (bf16 at two token
# blocks: Mistral-7B only); one token block (fp16: bench/results/h200_gemv_sweep_v29.txt, M = 1; bf16:
# h200_gemv_sweep_v37_bf16_m1.txt, M = 1 and 8) and two (M = 16, h200_gemv_sweep_v36_m16.txt).
_H200_SWEEP = {
    ("float16", 1): [
        (3, {3: 6.0, 4: 7.1, 2: 7.2, "2x2": 7.5}), (2, {2: 5.2, 3: 5.5, 4: 6.8, "2x2": 5.2}),
        (14, {3: 19.2, 4: 20.3, 2: 20.5, "2x2": 20.0}), (2, {2: 11.8, 3: 13.8, 4: 16.8, "2x2": 11.8}),
        (5, {3: 15.8, 2: 17.3, 4: 19.4, "2x2": 17.0}), (4, {4: 12.3, 2: 13.0, 3: 15.2, "2x2": 12.8}),
        (28, {4: 67.1, 3: 70.5, 2: 73.3, "2x2": 70.2}), (4, {4: 35.5, 2: 38.1, 3: 46.4, "2x2": 37.0})],
    ("float16", 2): [
        (3, {3: 7.8, 4: 8.5, "2x2": 8.8, 2: 8.9}), (2, {2: 6.2, "2x2": 6.4, 3: 7.3, 4: 8.1}),
        (14, {3: 24.7, "2x2": 25.0, 2: 25.4, 4: 26.1}), (2, {2: 14.6, "2x2": 16.3, 3: 18.1, 4: 21.8}),
        (5, {3: 20.5, "2x2": 21.5, 2: 21.7, 4: 25.4}), (4, {4: 15.1, "2x2": 15.4, 2: 15.6, 3: 20.0}),
        (28, {4: 87.0, 3: 87.6, "2x2": 89.3, 2: 93.8}), (4, {4: 45.0, 2: 46.2, "2x2": 46.5, 3: 60.9})],
    ("bfloat16", 1): [   # h200_gemv_sweep_v37_bf16_m1.txt: both models at M = 1, then at M = 8
        (3, {3: 6.1, 2: 7.1, 4: 7.4, "2x2": 7.4}), (2, {"2x2": 5.1, 2: 5.1, 3: 5.6, 4: 7.1}),
        (14, {"2x2": 19.3, 3: 19.3, 2: 20.2, 4: 20.3}), (2, {"2x2": 11.5, 2: 11.7, 3: 14.1, 4: 18.1}),
        (5, {3: 15.9, "2x2": 16.4, 2: 17.1, 4: 20.0}), (4, {4: 12.2, "2x2": 12.5, 2: 12.8, 3: 15.7}),
        (28, {4: 65.2, "2x2": 67.7, 3: 69.4, 2: 72.0}), (4, {4: 34.8, "2x2": 35.6, 2: 37.3, 3: 48.1}),
        (3, {3: 6.4, 2: 7.5, 4: 7.6, "2x2": 7.8}), (2, {"2x2": 5.5, 2: 5.6, 3: 5.8, 4: 7.2}),
        (14, {"2x2": 19.7, 3: 19.8, 4: 20.9, 2: 21.0}), (2, {"2x2": 12.0, 2: 12.4, 3: 14.5, 4: 18.3}),
        (5, {3: 16.4, "2x2": 16.9, 2: 17.8, 4: 20.3}), (4, {4: 12.4, "2x2": 12.7, 2: 13.2, 3: 15.9}),
        (28, {4: 67.1, "2x2": 68.7, 3: 70.7, 2: 73.7}), (4, {4: 35.8, "2x2": 36.5, 2: 38.6, 3: 48.5})],
    ("bfloat16", 2): [
        (3, {3: 7.8, 4: 8.6, 2: 9.0, "2x2": 9.1}), (2, {2: 6.3, "2x2": 6.5, 3: 7.4, 4: 8.3}),
        (14, {3: 25.1, "2x2": 25.8, 2: 25.9, 4: 26.5}), (2, {2: 14.8, "2x2": 16.6, 3: 18.4, 4: 22.7})],
}


def test_gemv_slot_fit_reproduces_the_h200_choices():
    """tune's fit on the H200 sweep gives the built-in slot times; with the two-k-block pairs' slot times they
    never lose more than 0.1 us against each layer's fastest variant."""
    from awq_cupy.plans import gemv_kdepth_for, gemv_tiles_for
    from awq_cupy.tune import fit_gemv_kd2, fit_gemv_slot

    for (dt, nb), layers in _H200_SWEEP.items():
        slot = fit_gemv_slot([(b, {tw: us for tw, us in t.items() if tw != "2x2"}) for b, t in layers])
        assert slot == dispatch.H200_GEMV_SLOT[dt][nb], (dt, nb, slot)
        kd2 = fit_gemv_kd2(layers, slot)
        assert kd2 == dispatch.H200_GEMV_KD2_SLOT[dt][nb], (dt, nb, kd2)
        lost = 0.0
        for b, t in layers:
            tw = gemv_tiles_for(8 * nb, 132 * b, 132, dt, slot=slot)
            got = "2x2" if gemv_kdepth_for(132 * b, 132, tw, slot, kd2) == 2 else tw
            lost += t[got] - min(t.values())
        assert lost <= 0.1 + 1e-9, (dt, nb, lost)
    # no layer with two or more blocks per CTA, or a variant missing: nothing to fit
    assert fit_gemv_slot([(1, {2: 1.0, 3: 1.0, 4: 1.0}), (5, {2: 1.0, 4: 1.0})]) is None
    # a GPU where pairs win everywhere gets a table that picks pairs
    slot = fit_gemv_slot([(b, {2: 1.0 * b, 3: 2.0 * b, 4: 2.0 * b}) for b in (2, 3, 4, 5, 14)])
    assert all(gemv_tiles_for(1, 132 * b, 132, slot=slot) == 2 for b in (2, 3, 4, 5, 14, 28))


def test_gemv_slot_from_benchmark_rows():
    from awq_cupy.bench import Row
    from awq_cupy.plans import gemv_kdepth_for, gemv_tiles_for
    from awq_cupy.tune import gemv_kd2_from_rows, gemv_slot_from_rows

    rows = []
    for (K, N, b), (t2, t3, t4) in {(4096, 4096, 2): (5.5, 6.3, 7.2), (4096, 6144, 3): (7.7, 6.7, 7.4),
                                    (4096, 28672, 14): (21.0, 22.3, 20.4)}.items():
        for M in (1, 4, 16):
            for tw, us in ((2, t2), (3, t3), (4, t4)):
                rows.append(Row("m", f"{K}x{N}", K, N, M, f"gemv{tw}", us * (1.5 if M > 8 else 1.0), 0, 0, 0, 0))
        rows.append(Row("m", f"{K}x{N}", K, N, 1, "gemm", 99.0, 0, 0, 0, 0))      # other contenders ignored
    slot = gemv_slot_from_rows(rows, 132)
    assert set(slot) == {1, 2}
    for nb in (1, 2):
        for NT16, tiles in ((256, 2), (384, 3), (1792, 4)):
            assert gemv_tiles_for(8 * nb, NT16, 132, slot=slot[nb]) == tiles
    assert gemv_kd2_from_rows(rows, 132, slot) == {}        # no gemv2x2 rows: nothing to fit
    # two-k-block pairs measured: faster than pairs at 2 blocks per CTA, slower than threes at 3 and fours at 14
    for (K, N), us in {(4096, 4096): 5.0, (4096, 6144): 8.0, (4096, 28672): 21.5}.items():
        for M in (1, 4, 16):
            rows.append(Row("m", f"{K}x{N}", K, N, M, "gemv2x2", us * (1.5 if M > 8 else 1.0), 0, 0, 0, 0))
    kd2 = gemv_kd2_from_rows(rows, 132, slot)
    assert set(kd2) == {1, 2}
    for nb in (1, 2):
        for NT16, want in ((256, 2), (384, 1), (1792, 1)):
            tw = gemv_tiles_for(8 * nb, NT16, 132, slot=slot[nb])
            assert gemv_kdepth_for(NT16, 132, tw, slot[nb], kd2[nb]) == want, (nb, NT16)


def test_gemv_slot_in_the_dispatch_table(tmp_path, monkeypatch):
    """A tuned row's gemv_slot survives the JSON file (string keys there) and steers plan_gemv; bad tables fail
    with the field named."""
    path = tmp_path / "dispatch.json"
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.reload()
    assert plan_gemv(1, 4096, 6144, 128).tiles == 3                      # built-in (H200) slot times
    pairs = {"float16": {1: {2: 1.0, 3: 2.0, 4: 2.0}}}
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, gemv_slot=pairs)}, {})
    row = dispatch.for_arch("90")
    assert row.gemv_slot == pairs and row.gemv_slot_for("float16", 1) == {2: 1.0, 3: 2.0, 4: 2.0}
    assert row.gemv_slot_for("float16", 2) == dispatch.H200_GEMV_SLOT["float16"][2]   # not measured: the H200's
    assert row.gemv_slot_for("bfloat16", 1) == dispatch.H200_GEMV_SLOT["bfloat16"][1]
    assert plan_gemv(1, 4096, 6144, 128).tiles == 2
    assert plan_gemv(16, 4096, 6144, 128).tiles == 3
    assert plan_gemv(1, 4096, 6144, 128, dtype="bfloat16").tiles == 3
    assert hash(row) == hash(dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768))
    _assert_rejected(path, "gemv_slot", (
        ({"float32": {1: {2: 1.0}}}, "float32"), ({"float16": {5: {2: 1.0}}}, "token blocks"),
        ({"float16": {1: {5: 1.0}}}, "tiles"), ({"float16": {4: {4: 1.0}}}, "tiles"), ({"float16": {1: {2: -1.0}}}, "positive"),
        ({"float16": {1: {2: "x"}}}, "positive"), ({"float16": {1: 3}}, "tiles: time"), ({}, "non-empty")),
        {"float16": {"1": {"2": 0}}})


def _assert_rejected(path, field, bads, stored):
    """Each (bad value, message part) of a dispatch row field fails with that message; a table file whose row has
    ``stored`` there fails with the field named."""
    import json

    for bad, what in bads:
        with pytest.raises(ValueError, match=what):
            dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, **{field: bad})
    path.write_text(json.dumps({"table": {"90": {"gemv_max_m": 16, "cublas_min_m": 768, field: stored}}}))
    dispatch.reload()
    with pytest.raises(ValueError, match=field):
        dispatch.for_arch("90")
    dispatch.reload()


def test_gemv_kd2_slot_in_the_dispatch_table(tmp_path, monkeypatch):
    """A tuned row's slot time of the two-64-k-block pairs survives the JSON file and steers plan_gemv; a row
    without one takes the H200's; bad values fail with the field named."""
    path = tmp_path / "dispatch.json"
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.reload()
    assert plan_gemv(1, 4096, 4096, 128).kdepth == 2                      # built-in (H200): o on KD 2 pairs
    builtin16 = plan_gemv(16, 4096, 4096, 128)                               # (the scaled plain pairs, v36)
    never = {"float16": {1: 1.5}}
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768, gemv_kd2_slot=never)}, {})
    row = dispatch.for_arch("90")
    assert row.gemv_kd2_slot == never and row.gemv_kd2_for("float16", 1) == 1.5
    assert row.gemv_kd2_for("float16", 2) == dispatch.H200_GEMV_KD2_SLOT["float16"][2]   # not measured: the H200's
    assert plan_gemv(1, 4096, 4096, 128).kdepth == 1 and plan_gemv(1, 4096, 4096, 128).tiles == 2
    assert plan_gemv(16, 4096, 4096, 128) == builtin16
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=16, cublas_min_m=768,
                                                         gemv_kd2_slot={"float16": {2: 1.0}})}, {})
    assert plan_gemv(16, 4096, 4096, 128).kdepth == 2                    # a row that measured them faster
    assert dispatch.TABLE["default"].gemv_kd2_for("float32", 1) is None
    _assert_rejected(path, "gemv_kd2_slot", (
        ({"float32": {1: 1.0}}, "float32"), ({"float16": {3: 1.0}}, "token blocks"), ({"float16": {1: 0}}, "positive"),
        ({"float16": {1: "x"}}, "positive"), ({"float16": {"a": 1.0}}, "token blocks"), ({}, "non-empty")),
        {"float16": {"1": -1}})


def test_tune_choice_from_measurements():
    from awq_cupy.tune import choose

    sums = {1: dict(gemv=50, gemm=90, dequant_cublas=400), 8: dict(gemv=60, gemm=90, dequant_cublas=400),
            16: dict(gemv=100, gemm=95, dequant_cublas=400), 64: dict(gemm=150, dequant_cublas=300),
            128: dict(gemm=320, dequant_cublas=340), 256: dict(gemm=580, dequant_cublas=350),
            512: dict(gemm=1100, dequant_cublas=600)}
    assert choose(sums) == (8, 256, None)
    # cuBLAS never wins: one past the largest M; bf16 (no cuBLAS path) likewise
    assert choose({1: dict(gemv=1, gemm=2), 32: dict(gemm=5)}) == (1, 33, None)
    # the GEMV loses already at M = 1
    assert choose({1: dict(gemv=3, gemm=2, dequant_cublas=9)}) == (0, 2, None)


def test_tune_choice_between_the_two_gemm_kernels():
    from awq_cupy.tune import choose

    # the H200's measurements after v12 (bench/results/dispatch_h200.json, docs/history.md v12), in us
    sums = {8: dict(gemv=63, gemm_sw=92, gemm_wg=95, dequant_cublas=297),
            12: dict(gemv=92, gemm_sw=93, gemm_wg=96, dequant_cublas=296),
            16: dict(gemv=100, gemm_sw=88, gemm_wg=94, dequant_cublas=296),
            32: dict(gemm_sw=104, gemm_wg=109, dequant_cublas=298),
            48: dict(gemm_sw=145, gemm_wg=125, dequant_cublas=300),
            128: dict(gemm_sw=299, gemm_wg=184, dequant_cublas=356),
            256: dict(gemm_sw=559, gemm_wg=393, dequant_cublas=357)}
    assert choose(sums) == (12, 256, 48)
    # the GEMV is compared with the GEMM kernel the table picks at that M (here mma.sync: 88 < 100)
    sums[16]["gemm_wg"] = 80
    assert choose(sums) == (12, 256, 48)
    # wgmma never wins at the largest M: never used
    assert choose({16: dict(gemv=100, gemm_sw=88, gemm_wg=94), 64: dict(gemm_sw=1, gemm_wg=2)})[2] is None
    # wgmma wins everywhere: from the smallest measured M
    assert choose({16: dict(gemv=100, gemm_sw=88, gemm_wg=80), 64: dict(gemm_sw=3, gemm_wg=2)}) == (0, 65, 16)


def test_tune_with_a_cost_model_starts_cublas_where_some_layer_wins():
    from awq_cupy.tune import choose

    sums = {8: dict(gemv=10, gemm_sw=20, gemm_wg=20), 512: dict(gemm_sw=90, gemm_wg=50, dequant_cublas=60),
            1024: dict(gemm_sw=180, gemm_wg=100, dequant_cublas=99), 2048: dict(gemm_sw=400, gemm_wg=200,
                                                                                 dequant_cublas=150)}
    layers = {("a", 512): dict(gemm_wg=20, dequant_cublas=19), ("b", 512): dict(gemm_wg=30, dequant_cublas=41),
              ("a", 1024): dict(gemm_wg=40, dequant_cublas=39), ("b", 128): dict(gemm_wg=1, dequant_cublas=0.5)}
    assert choose(sums)[1] == 1024                      # the sums: from 1024 on
    assert choose(sums, layers)[1] == 512               # layer a already at 512 (M < 256 never counts)
    assert choose(sums, {("a", 512): dict(gemm_wg=1, dequant_cublas=2)})[1] == 2049


def test_tuned_table_round_trip_and_precedence(tmp_path, monkeypatch):
    path = tmp_path / "dispatch.json"
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.reload()
    assert dispatch.for_arch("90") == dispatch.TABLE["90"]          # no file yet: built-in
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=4, cublas_min_m=128)}, {"90": {"x": 1}})
    assert dispatch.for_arch("90") == dispatch.Dispatch(4, 128)
    assert dispatch.for_arch("80") == dispatch.TABLE["default"]     # archs without a tuned row
    assert rounds_weights(5) and not rounds_weights(4)
    dispatch.write_table(path, {"80": dispatch.Dispatch(gemv_max_m=8, cublas_min_m=512)}, {})
    assert dispatch.for_arch("90") == dispatch.Dispatch(4, 128) and dispatch.for_arch("80").cublas_min_m == 512
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", "builtin")
    settings.reload()
    assert dispatch.for_arch("90") == dispatch.TABLE["90"]
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    path.write_text('{"table": {"90": {"gemv_max_m": 64, "cublas_min_m": 128}}}')
    dispatch.reload()                                               # edited behind write_table's back
    with pytest.raises(ValueError, match="gemv_max_m=64"):
        dispatch.for_arch("90")
    path.write_text('{"table": {"90": {"gemv_max_m": 8, "cublas_min_m": 128}}}')   # written before wgmma_min_m
    dispatch.reload()                                               # and gemv_wide_max_m: the built-in row's
    assert dispatch.for_arch("90") == dispatch.Dispatch(8, 128, dispatch.TABLE["90"].wgmma_min_m,
                                                        gemv_wide_max_m=dispatch.TABLE["90"].gemv_wide_max_m)
    path.write_text('{"table": {"90": {"gemv_max_m": 8, "cublas_min_m": 24}}}')     # no room for it: 0
    dispatch.reload()
    assert dispatch.for_arch("90").gemv_wide_max_m == 0 and dispatch.for_arch("80").gemv_wide_max_m == 0
    path.write_text('{"table": {"90": {"gemv_max_m": 8, "cublas_min_m": 128, "gemv_wide_max_m": 40}}}')
    dispatch.reload()
    with pytest.raises(ValueError, match="gemv_wide_max_m=40 must be 0 or 17 to 32"):
        dispatch.for_arch("90")
    path.write_text('{"table": {"90": {"gemv_max_m": 8, "cublas_min_m": 128, "wgmma_min_m": 0}}}')
    dispatch.reload()
    with pytest.raises(ValueError, match="wgmma_min_m=0 must be a positive integer or None"):
        dispatch.for_arch("90")
    path.write_text("not json")
    dispatch.reload()
    with pytest.raises(ValueError, match="not a valid"):
        dispatch.for_arch("90")


def test_dispatch_rows_are_validated():
    with pytest.raises(ValueError, match="cublas_min_m"):
        dispatch.Dispatch(gemv_max_m=8, cublas_min_m=8)
    with pytest.raises(ValueError, match="non-negative integer"):
        dispatch.Dispatch(gemv_max_m=-1, cublas_min_m=8)


@pytest.mark.parametrize("k_stages,n_ctas,m_tiles", [(64, 112, 1), (64, 16, 1), (224, 16, 4), (1, 1, 1), (3, 2, 64),
                                                    (224, 16, 1), (64, 24, 1)])
@pytest.mark.parametrize("resident", [132, 264, 528])
@pytest.mark.parametrize("M,Np", [(1, 64), (64, 4096), (255, 28672)])
def test_gemm_splits_partition_k(k_stages, n_ctas, m_tiles, resident, M, Np):
    splits, per = plan_splits(k_stages, n_ctas, m_tiles, resident=resident, M=M, Np=Np)
    assert splits >= 1 and per >= 1
    assert (splits - 1) * per < k_stages <= splits * per, "every split gets work and K is covered"
    assert splits == 1 or per >= 4, "at least 4 stages per split"


def test_gemm_splits_avoid_a_partial_last_wave():
    # Mistral-7B down at M = 64 (16 CTAs, 224 stages) on 264 resident CTAs: 16 splits fill one wave, where the
    # earlier rule took 17 (two waves)
    assert plan_splits(224, 16, 1, resident=264, M=64, Np=4096) == (16, 14)
    # gate_up at M = 64 (112 CTAs, 64 stages): 2 splits in one wave, not 3 splits in 1.3 waves
    assert plan_splits(64, 112, 1, resident=264, M=64, Np=28672) == (2, 32)
    # the partial sums' traffic counts: at M = 128 the same layer is not split at all
    assert plan_splits(64, 112, 2, resident=264, M=128, Np=28672) == (1, 64)


def test_gemm_splits_count_co_resident_ctas_as_sharing_an_sm():
    from awq_cupy.plans import _unit_us

    # Mistral-7B o at M = 128 on the wgmma (16, 1, 4) shape, two CTAs per SM of 132: 5 splits put two CTAs on 28
    # SMs (measured 23.3 us) where 4 splits run one per SM (20.4 us); as 264 independent slots 5 looked better
    args = dict(resident=264, M=128, Np=4096, stage_us=_unit_us(16, 1, True), min_per=2)
    assert plan_splits(64, 32, 1, per_sm=2, **args) == (4, 16)
    assert plan_splits(64, 32, 1, per_sm=1, **args)[0] == 5
    # Mistral-7B down at M = 64 on (8, 1, 6), two per SM: 8 splits (measured 30.2 us; 4: 35.2, 16: 34.4)
    assert plan_splits(224, 32, 1, resident=264, per_sm=2, M=64, Np=4096, stage_us=_unit_us(8, 1, True),
                       min_per=2)[0] == 8


def test_gemm_plan_with_two_k_streams():
    """ksplit = 2 halves the channels per CTA (twice the column tiles) and exists for the wgmma GEMM only."""
    one = plan_gemm(256, 4096, 6144, 128, wgmma=True, resident=132, ksplit=1)
    two = plan_gemm(256, 4096, 6144, 128, wgmma=True, resident=132, ksplit=2)
    assert two.grid[0] == 2 * one.grid[0] and two.ksplit == 2 and one.ksplit == 1
    assert plan_gemm(256, 4096, 6144, 128, wgmma=True, resident=132, ksplit=2, splits=1).splits == 1
    with pytest.raises(ValueError, match="ksplit=3"):
        plan_gemm(256, 4096, 6144, 128, wgmma=True, ksplit=3)
    with pytest.raises(ValueError, match="ksplit=2"):
        plan_gemm(256, 4096, 6144, 128, wgmma=False, ksplit=2)


# K x N of the benchmark models' layers by the names the planner tables below use; l_: Llama-2-70B
_LAYERS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
           "l_qkv": (8192, 10240), "l_o": (8192, 8192), "l_down": (28672, 8192)}


# (layer, M): the one-stream split count and whether two K streams are planned (docs/history.md v23, H200 runs;
# four splits at M = 256: v52, H100)
_KSPLIT_CASES = {("qkv", 256): (2, True), ("qkv", 128): (2, True), ("o", 512): (2, True), ("down", 512): (2, True),
                 ("o", 128): (4, False), ("o", 256): (4, True), ("down", 128): (4, False),
                 ("down", 256): (4, True), ("down", 768): (4, True), ("gate_up", 256): (1, False),
                 ("qkv", 64): (5, False),
                 ("o", 64): (4, False), ("l_o", 128): (2, False), ("l_o", 256): (2, True),
                 ("l_down", 128): (2, False), ("l_down", 256): (2, False)}


def test_two_k_streams_replace_a_two_way_split_on_large_token_tiles():
    """The default plan takes two K streams per CTA exactly where the one-stream plan splits K two ways on a token
    tile of 128 or more with at most 16 units per stream, or, where the GEMM reads x through the tensor map (the
    256-token tile that M fills), with up to 112 units per stream (Mistral-7B down at 512, Llama-2-70B o at 256,
    not its down with 224): there they replace the split (same CTAs, no partials, no reduce kernel) and measured
    faster; with longer streams, where four splits would become two after the x tile pass, or where nothing is
    split, they measured slower or tied. Four splits on the 256-token tile become two streams x two splits (same
    CTAs, half the partials), which measured faster on Mistral-7B o and down at M = 256, and at 768 on down with
    the tensor map (not on the 128-token tile; there now ending in a split tail launch, as measured faster)."""
    for (layer, M), (one_splits, two) in _KSPLIT_CASES.items():
        K, N = _LAYERS[layer]
        one = plan_gemm(M, K, N, 128, wgmma=True, resident=132, ksplit=1)
        auto = plan_gemm(M, K, N, 128, wgmma=True, resident=132)
        assert one.splits == one_splits, (layer, M, one)
        assert auto.ksplit == (2 if two else 1), (layer, M, auto)
        if two and auto.tail is not None:   # two streams and a split tail (_KSPLIT_TMA_TAILS), where measured
            assert (layer, M) in _KSPLIT_TAIL_MEASURED, (layer, M, auto)
        elif two:   # the same CTAs, K split half as many ways
            assert auto.splits == one.splits // 2 and math.prod(auto.grid) == math.prod(one.grid), (layer, M, auto)
        else:
            assert auto == one
    # never for the mma.sync kernel, batch-invariant calls or forced split counts
    assert plan_gemm(256, 4096, 6144, 128, wgmma=False, resident=132).ksplit == 1
    assert plan_gemm(256, 4096, 6144, 128, wgmma=True, resident=132, batch_invariant=True).ksplit == 1
    assert plan_gemm(256, 4096, 6144, 128, wgmma=True, resident=132, splits=2).ksplit == 1


# H100, v55 (bench/results/h100_ks_ab_*_v55.txt): the wgmma GEMM where the 256-token tile reads x through the tensor
# map, one K stream (its planned splits or split tail) against two, us per call: (layer, M): (one, two)
_KSPLIT_TMA_MEASURED = {
    ("qkv", 512): (43.5, 49.4), ("qkv", 768): (64.8, 74.5), ("qkv", 1024): (80.7, 77.5),
    ("o", 1024): (46.8, 51.3), ("o", 1536): (81.1, 77.4),
    ("down", 512): (88.2, 85.2), ("down", 768): (148.5, 146.2), ("down", 1024): (156.2, 170.9),
    ("down", 1536): (243.9, 256.0),
    ("l_qkv", 512): (123.5, 145.1), ("l_qkv", 1024): (236.1, 258.4), ("l_o", 256): (54.6, 50.0),
    ("l_o", 768): (146.2, 150.1), ("l_down", 256): (164.0, 168.9), ("l_down", 768): (495.2, 511.7)}


def test_two_k_streams_with_the_tensor_map_where_measured_faster():
    """Where the GEMM reads x through the tensor map, the planner takes two K streams in exactly the measured cells
    where they ran faster than one stream with its splits or split tail (plans._KSPLIT_TMA: by the split-K model,
    with units per stream bounded as measured): in place of splits with up to 112 units per stream, in place of a
    tail with up to 32; never where x goes through the tile pass, for batch-invariant calls or forced splits."""
    for (layer, M), (one, two) in _KSPLIT_TMA_MEASURED.items():
        K, N = _LAYERS[layer]
        assert plans.x_by_tensor_map(M, N, gemm_shape_for(M, wgmma=True)), (layer, M)
        p = plan_gemm(M, K, N, 128, wgmma=True, resident=132)
        assert p.ksplit == (2 if two < one else 1), (layer, M, p, one, two)
    # Mistral-7B qkv at M = 1024: 384 CTAs of two streams (2.91 waves) instead of a wave and a split tail
    p = plan_gemm(1024, 4096, 6144, 128, wgmma=True, resident=132)
    assert (p.grid, p.splits, p.tail) == ((96, 1, 4), 1, None)
    assert plan_gemm(1000, 4096, 6144, 128, wgmma=True, resident=132).ksplit == 1        # the tile pass (M % 256)
    assert plan_gemm(1024, 4096, 6144, 128, wgmma=True, resident=132, batch_invariant=True).ksplit == 1
    assert plan_gemm(1024, 4096, 6144, 128, wgmma=True, resident=132, splits=1).ksplit == 1
    assert plan_gemm(1024, 4096, 6144, 128, wgmma=True, resident=132, tail=False).ksplit == 2


# H100 (bench/results/h100_k2tail_ab_*_v56.txt): the planner's plan and two K streams ending in a split tail
# launch (forced), us per call; l_ = Llama-2-70B. The plan splits K over its whole grid in the two cells that won.
_KSPLIT_TAIL_MEASURED = {
    ("qkv", 512): (43.6, 46.2), ("qkv", 768): (64.1, 64.9), ("qkv", 1536): (113.8, 124.5),
    ("o", 768): (43.5, 46.1), ("down", 768): (146.9, 136.4),
    ("l_qkv", 256): (76.1, 69.1), ("l_qkv", 512): (121.9, 129.8), ("l_qkv", 768): (175.5, 199.6),
    ("l_qkv", 1536): (352.3, 390.3)}


def test_two_k_streams_end_in_a_tail_where_measured_faster():
    """plans._KSPLIT_TMA_TAILS: two K streams with a split tail launch are planned in exactly the measured cells
    where they ran faster than the plan, which there split K over the whole grid; not in place of an unsplit plan
    or a one-stream tail (they lost in all such cells though the model gave them 2-8%), not with the flag off."""
    for (layer, M), (plan_us, tail_us) in _KSPLIT_TAIL_MEASURED.items():
        K, N = _LAYERS[layer]
        p = plan_gemm(M, K, N, 128, wgmma=True, resident=132)
        won = tail_us < 0.97 * plan_us
        assert (p.ksplit == 2 and p.tail is not None) == won, (layer, M, p, plan_us, tail_us)
        if won:   # what the flag replaces: a split plan, which it gives back when off
            q = plan_gemm(M, K, N, 128, wgmma=True, resident=132, tail=False)
            assert q.splits > 1 and q.tail is None, (layer, M, q)
        forced = plan_gemm(M, K, N, 128, wgmma=True, resident=132, ksplit=2, tail=True)
        assert forced.ksplit == 2 and forced.tail is not None and forced.tail.splits >= 2, (layer, M, forced)
    # Mistral-7B down at M = 768: 132 CTAs of two unsplit streams (224 units), then 60 column tiles split two ways
    p = plan_gemm(768, 14336, 4096, 128, wgmma=True, resident=132)
    assert (p.grid, p.splits, p.ksplit, p.tail) == ((44, 1, 3), 1, 2, plans.TailSplit(20, 2, 112))


def test_reduce_columns_keep_enough_blocks_per_sm():
    """8 columns per thread while that leaves four 256-thread blocks per SM, 4 while it leaves two, else 2; always a
    divisor of N (N % 8 == 0 for every AWQ layout)."""
    from awq_cupy.plans import reduce_columns

    assert reduce_columns(256, 6144, 132) == 8      # qkv at M = 256: 196608 items of 8, 5.8 blocks per SM
    assert reduce_columns(256, 4096, 132) == 4      # o / down at M = 256: 3.9 blocks per SM with 8, 7.8 with 4
    assert reduce_columns(512, 4096, 132) == 8
    assert reduce_columns(64, 4096, 132) == 2       # 1.9 blocks per SM with 4 columns
    assert reduce_columns(128, 4096, 132) == 4
    assert reduce_columns(1, 8, 132) == 2
    assert reduce_columns(256, 4096, 16) == 8       # a small GPU fills with fewer threads
    for M in (1, 3, 64, 257, 4096):
        for N in (8, 136, 4096, 28672):
            assert N % reduce_columns(M, N, 132) == 0


# H200, v22 (bench/results/h200_gemm_ab_splits_v22.txt): the wgmma GEMM on Mistral-7B's split layers, us per call
# for forced split counts; the planner's own choice of that run is measured as "base" and listed under its count.
_H200_SPLITS_V22 = {
    ("qkv", 32): {5: 12.7, 2: 21.0, 3: 16.7, 4: 13.7, 6: 16.8, 8: 15.6, 12: 15.1, 16: 17.6},
    ("qkv", 48): {5: 15.4, 2: 24.5, 3: 18.8, 4: 16.2, 6: 20.3, 8: 18.0, 12: 18.2, 16: 22.3},
    ("qkv", 64): {5: 16.0, 2: 24.6, 3: 20.2, 4: 16.7, 6: 21.4, 8: 19.6, 12: 19.3, 16: 23.7},
    ("qkv", 96): {2: 22.0, 3: 25.2, 4: 21.6, 6: 28.3, 8: 24.1, 12: 25.9, 16: 32.1},
    ("qkv", 128): {2: 22.8, 3: 26.5, 4: 22.8, 6: 30.4, 8: 29.1, 12: 29.3, 16: 38.8},
    ("o", 32): {2: 21.0, 3: 16.7, 4: 13.9, 6: 12.0, 8: 10.4, 12: 13.1, 16: 13.1},
    ("o", 48): {2: 23.5, 3: 18.5, 4: 15.7, 6: 13.5, 8: 11.9, 12: 15.3, 16: 16.0},
    ("o", 64): {2: 24.2, 3: 18.7, 4: 16.3, 6: 14.0, 8: 12.8, 12: 16.5, 16: 16.9},
    ("o", 96): {2: 21.4, 3: 17.7, 4: 15.3, 6: 18.5, 8: 16.9, 12: 21.6, 16: 23.3},
    ("o", 128): {2: 21.9, 3: 17.9, 4: 16.0, 6: 19.1, 8: 18.7, 12: 26.7, 16: 26.7},
    ("down", 32): {2: 57.8, 3: 40.6, 4: 32.9, 6: 25.0, 8: 20.4, 12: 24.1, 16: 22.7},
    ("down", 48): {2: 67.0, 3: 47.7, 4: 37.9, 6: 28.8, 8: 23.6, 12: 27.3, 16: 26.8},
    ("down", 64): {2: 67.3, 3: 47.2, 4: 38.4, 6: 29.5, 8: 24.4, 12: 28.3, 16: 28.3},
    ("down", 96): {2: 54.7, 3: 40.8, 4: 33.2, 6: 38.5, 8: 32.3, 12: 38.2, 16: 39.2},
    ("down", 128): {2: 55.6, 3: 41.2, 4: 33.7, 6: 40.3, 8: 34.2, 12: 43.8, 16: 42.6},
}


def _h200_wgmma_splits(M, K, N):
    """The split count launch.run_gemm plans for the wgmma GEMM on the H200 (132 SMs): the (n, 1, 6) shapes and
    the 128-token tile's PEND = 2 variant fit two CTAs per SM, the other shapes one (their registers)."""
    import math

    from awq_cupy.kernels import GEMM_WG_PEND_TWO_PER_SM
    from awq_cupy.plans import gemm_shape_for

    shape = gemm_shape_for(M, wgmma=True)
    p = plan_gemm(M, K, N, 128, wgmma=True, resident=264 if shape[2] == 6 else 132, ksplit=1)
    if shape in GEMM_WG_PEND_TWO_PER_SM:
        two = plan_gemm(M, K, N, 128, wgmma=True, resident=264, ksplit=1)
        own = plans.PEND_TWO_OWN_GRID and two.per >= plans._PEND_TWO_MIN_UNITS
        if max(math.prod(p.grid), math.prod(two.grid) if own else 0) > 132:
            p = two
    return p.splits


def test_wgmma_split_plan_is_near_the_measured_best():
    """On every measured case the planned split count runs within 1 us of the fastest measured one."""
    for (layer, M), times in _H200_SPLITS_V22.items():
        s = _h200_wgmma_splits(M, *_LAYERS[layer])
        assert s in times, (layer, M, s)
        assert times[s] <= min(times.values()) + 1.0, (layer, M, s, times)


# H200, v33 (bench/results/h200_gemm_plan_sweep_v33.txt, first round): the wgmma GEMM at M = 128..512 under every
# (K streams per CTA, split count) of the default token tile, us per call; the planner's own launch of that run is
# listed under its (ksplit, splits).
_H200_PLANS_V33 = {
    ("qkv", 128): {(2, 1): 21.8, (2, 2): 28.1, (1, 2): 22.1, (1, 3): 25.8, (1, 4): 22.2, (1, 6): 29.6},
    ("qkv", 256): {(2, 1): 28.9, (2, 2): 39.4, (1, 2): 31.9, (1, 3): 43.8, (1, 4): 40.4, (1, 6): 46.8},
    ("qkv", 512): {(1, 1): 49.2, (2, 1): 57.3, (2, 2): 60.3, (1, 2): 61.5, (1, 3): 68.4, (1, 4): 63.8},
    ("o", 128): {(1, 4): 15.5, (2, 1): 21.2, (2, 2): 16.6, (1, 2): 21.4, (1, 3): 17.5, (1, 6): 18.6},
    ("o", 256): {(1, 4): 22.4, (2, 1): 28.3, (2, 2): 22.6, (1, 2): 30.8, (1, 3): 25.5, (1, 6): 33.1},
    ("o", 512): {(2, 1): 30.7, (2, 2): 41.1, (1, 2): 34.0, (1, 3): 47.1, (1, 4): 42.9, (1, 6): 52.9},
    ("down", 128): {(1, 4): 33.3, (2, 1): 61.2, (2, 2): 37.3, (1, 2): 55.2, (1, 3): 41.1, (1, 6): 39.5},
    ("down", 256): {(1, 4): 51.1, (2, 1): 79.8, (2, 2): 52.4, (1, 2): 80.1, (1, 3): 58.7, (1, 6): 69.6},
    ("down", 512): {(1, 2): 93.6, (2, 1): 91.4, (2, 2): 103.9, (1, 3): 121.3, (1, 4): 102.2, (1, 6): 112.1},
}


def test_wgmma_stream_and_split_plan_is_near_the_measured_best():
    """At M = 128..512 (one CTA per SM: the 128-token tile's two-per-SM variant is not taken on these grids) the
    planned (K streams, split count) is one that was measured, and within 3% of the fastest (down at M = 512: two
    K streams, 91.4 us, against the 2-way split's 93.6, planned since the tensor map)."""
    for (layer, M), times in _H200_PLANS_V33.items():
        p = plan_gemm(M, *_LAYERS[layer], 128, wgmma=True, resident=132)
        assert p.grid[0] * p.grid[1] * p.grid[2] <= 132 or M > 128, (layer, M, p.grid)
        key = (p.ksplit, p.splits)
        assert key in times, (layer, M, key)
        assert times[key] <= 1.03 * min(times.values()), (layer, M, key, times)


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("M", [1, 9, 16, 17, 32, 33, 64, 65, 128, 129, 255, 256, 257, 1000])
def test_gemm_shape_holds_m(M, wgmma):
    from awq_cupy.plans import gemm_token_tile

    shapes, default = (kernels.GEMM_WG_SHAPES, kernels.GEMM_WG_DEFAULT) if wgmma else (kernels.GEMM_SHAPES,
                                                                                       kernels.GEMM_DEFAULT)
    nb, tw, depth = shape = gemm_shape_for(M, wgmma=wgmma)
    assert shape in shapes
    tile = 8 * nb
    assert tile == gemm_token_tile(M, wgmma)
    assert tile >= M or tile == max(default), "one token tile up to the largest"
    assert tile == min(default) or tile // 2 < M, "the smallest token tile that holds M"


@pytest.mark.parametrize("wgmma", [False, True])
def test_every_gemm_shape_is_reachable_and_every_tile_has_a_default(wgmma):
    shapes, default = (kernels.GEMM_WG_SHAPES, kernels.GEMM_WG_DEFAULT) if wgmma else (kernels.GEMM_SHAPES,
                                                                                       kernels.GEMM_DEFAULT)
    for tile, shape in default.items():
        assert shape in shapes and 8 * shape[0] == tile
    for nb, tw, depth in shapes:
        assert 8 * nb in default
        assert gemm_shape_for(8 * nb, tw, wgmma=wgmma)[:2] == (nb, tw)


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("K,N", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8, 8), (1000, 200)])
@pytest.mark.parametrize("M", [13, 16, 64, 128, 300])
def test_plan_gemm_covers_the_output_and_k(K, N, M, wgmma):
    p = plan_gemm(M, K, N, 128 if K % 128 == 0 else K, wgmma=wgmma)
    n_ctas, splits, m_tiles = p.grid
    n_ctas += p.tail.ctas if p.tail else 0   # a tail launch takes the last column tiles
    per_cta = 8 // p.ksplit * p.tiles * 16   # channels per CTA: two K streams share a warpgroup's channels
    assert n_ctas * per_cta >= N > (n_ctas - 1) * per_cta
    assert m_tiles * 8 * p.token_blocks >= M > (m_tiles - 1) * 8 * p.token_blocks
    KS = -(-K // 64)
    assert splits == p.splits and (splits - 1) * p.per < KS <= splits * p.per
    if p.tail is not None:
        t = p.tail
        assert p.splits == 1 and p.tail_grid == (t.ctas, t.splits, m_tiles)
        assert t.splits >= 2 and (t.splits - 1) * t.per < KS <= t.splits * t.per
        assert p.tail_block0 == p.grid[0] * per_cta // 16


@pytest.mark.parametrize("wgmma", [False, True])
def test_plan_gemm_batch_invariant_split_ignores_m(wgmma):
    plans = {M: plan_gemm(M, 8192, 1024, 128, batch_invariant=True, wgmma=wgmma) for M in (1, 2, 17, 64, 300)}
    assert len({(p.splits, p.per) for p in plans.values()}) == 1


def h200_resident(variant, smem):
    """CTAs of ``variant`` one H200 SM holds: two of the 128-token tile's PEND 2 variant and of the smaller
    tiles, else one."""
    return 2 if variant.token_blocks < 16 or variant.pend == 2 else 1


# Grids the tail launch is planned for (H200, 132 SMs, one 256-token CTA per SM): a remainder of column tiles past
# whole waves that splits into one wave. (model, layer, K, N, M): (first tail column tile, tail splits)
# Mistral-7B qkv at M = 1024 runs two K streams instead (test_two_k_streams_with_the_tensor_map_where_measured_faster).
_TAILS = {("mistral-7b", "gate_up", 4096, 28672, 512): (198, 2),
          ("llama-2-70b", "gate_up", 8192, 57344, 256): (396, 2), ("llama-2-70b", "qkv", 8192, 10240, 512): (66, 4),
          ("llama-2-70b", "qkv", 8192, 10240, 1024): (66, 2), ("llama-2-70b", "gate_up", 8192, 57344, 2048): (445, 5),
          ("llama-2-70b", "qkv", 8192, 10240, 256): (132, 4),   # two K streams' tail (_KSPLIT_TMA_TAILS)
          ("llama-2-70b", "gate_up", 8192, 57344, 128): (264, 2)}   # pairs, then a lone last round (PAIR_TAILS)


def test_plan_gemm_tail_where_the_last_wave_is_partial():
    from awq_cupy import jit
    from awq_cupy.bench import MODELS
    from awq_cupy.plans import plan_gemm_launch

    for model, layers in MODELS.items():
        for name, K, N in layers:
            for M in (64, 128, 256, 512, 1024, 2048, 4096):
                for dtype in ("float16", "bfloat16"):
                    p = plan_gemm_launch(M, K, N, 128, dtype, jit.ARCHS["90a"], 132, h200_resident, wgmma=True)
                    got = (p.grid[0], p.tail.splits) if p.tail is not None else None
                    assert got == _TAILS.get((model, name, K, N, M)), (model, name, M, p)
                    assert p.tail is None or p.reduce_cols in (2, 4, 8)   # the tail's reduce is planned
                    assert plan_gemm(M, K, N, 128, wgmma=True, tail=False).tail is None


# Grids the tail launch was timed on against the one launch (H100 A/B, fp16 and bf16; docs/design.md §Split-K
# reduce): (model, layer, M) -> whether the tail measured faster in both dtypes. The planner must agree with each.
_TAIL_MEASURED = {("llama-2-70b", "gate_up", 2048): True, ("llama-2-70b", "qkv", 1536): True,
                  ("llama-2-70b", "down", 768): True, ("mistral-7b", "gate_up", 1100): True,
                  ("mistral-7b", "gate_up", 4096): False, ("llama-2-70b", "down", 3072): False}


def test_plan_gemm_tail_agrees_with_the_measured_grids():
    from awq_cupy.bench import MODELS
    from awq_cupy.plans import plan_gemm_launch

    for (model, name, M), faster in _TAIL_MEASURED.items():
        K, N = next((K, N) for n, K, N in MODELS[model] if n == name)
        for dtype in ("float16", "bfloat16"):
            p = plan_gemm_launch(M, K, N, 128, dtype, jit.ARCHS["90"], 132, h200_resident)
            assert (p.tail is not None) == faster, (model, name, M, dtype, p)


def test_row_split_models_the_one_call_with_its_fitted_tails():
    """row_split weighs the one call with the tails planned when its margin was fitted (3% modelled gain), not the
    ones planned at _TAIL_GAIN since: Mistral-7B gate_up at M = 1100 plans a tail modelled 2.8% faster, and the
    two calls (1024 rows, then 76) measured faster than the one call with or without it."""
    from awq_cupy.plans import _ROW_SPLIT_TAIL_GAIN, _TAIL_GAIN, plan_gemm_launch, row_split

    arch = jit.ARCHS["90"]
    assert _TAIL_GAIN > _ROW_SPLIT_TAIL_GAIN
    assert plan_gemm_launch(1100, 4096, 28672, 128, "float16", arch, 132, h200_resident).tail is not None
    assert plan_gemm_launch(1100, 4096, 28672, 128, "float16", arch, 132, h200_resident,
                            tail_gain=_ROW_SPLIT_TAIL_GAIN).tail is None
    assert row_split(1100, 4096, 28672, 128, "float16", arch, 132, h200_resident) == 1024
    assert row_split(1797, 8192, 57344, 128, "float16", arch, 132, h200_resident) == 1792   # then the GEMV's 5 rows
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="tail_gain"):
            plan_gemm_launch(1100, 4096, 28672, 128, "float16", arch, 132, h200_resident, tail_gain=bad)


def test_plan_gemm_tail_only_where_it_applies():
    # Llama-2-70B gate_up at M = 256: 448 column tiles, 396 of them in three whole waves
    base = dict(wgmma=True)
    assert plan_gemm(256, 8192, 57344, 128, **base).tail is not None
    assert plan_gemm(256, 8192, 57344, 128, wgmma=False).tail is None             # mma.sync: x has no tile pass
    assert plan_gemm(256, 8192, 57344, 128, batch_invariant=True, **base).tail is None   # sums must not depend on M
    assert plan_gemm(256, 8192, 57344, 128, splits=2, **base).tail is None         # a forced split is kept
    assert plan_gemm(256, 8192, 57344, 128, ksplit=2, **base).tail is None   # two K streams: only forced (below)
    assert plan_gemm(16, 4096, 4096, 128, tail=True, **base).tail is None           # one wave: nothing to split off
    assert plan_gemm(64, 8192, 57344, 128, tail=True, **base).tail is None          # tiles below 128 tokens
    forced = plan_gemm(4096, 4096, 28672, 128, tail=True, **base)                   # modelled 1.7% faster only
    assert forced.tail is not None and plan_gemm(4096, 4096, 28672, 128, **base).tail is None


def test_two_k_streams_take_a_tail_where_forced_or_in_place_of_splits(monkeypatch):
    """Two K streams end in a split tail launch where it is forced (GPU tests, A/B runs) or, with
    plans._KSPLIT_TMA_TAILS, where the model says so in place of a one-stream plan that splits K: whole waves of
    unsplit 64-channel CTAs, then the rest split K ways, the tail's first column block counted in 64-channel
    tiles. In place of an unsplit plan they are not planned even where modelled faster (they measured slower)."""
    from awq_cupy.plans import gemm_modelled_us, tail_split_cost

    # Mistral-7B qkv at M = 512: 96 column tiles of 64 channels x 2 token tiles; one wave holds 66 of them
    p = plan_gemm(512, 4096, 6144, 128, wgmma=True, resident=132, ksplit=2, tail=True)
    assert (p.grid, p.splits, p.per, p.ksplit) == ((66, 1, 2), 1, 64, 2)
    assert (p.tail.ctas, p.tail.splits, p.tail.per) == (30, 2, 32) and p.tail_grid == (30, 2, 2)
    assert p.tail_block0 == 66 * 4                                     # four 16-column blocks per CTA
    one = lambda v, smem: 1   # noqa: E731
    t = gemm_modelled_us(p, 512, 4096, 6144, "float16", 132, one)
    assert t == pytest.approx(tail_split_cost(64, 96, 2, resident=132, M=512, Np=6144, stage_us=0.39, min_per=4,
                                              per_sm=1, share=0.1, cols_per_tile=64, tensor_us=0.39)[0])
    plain = plan_gemm(512, 4096, 6144, 128, wgmma=True, resident=132)
    assert plain.ksplit == 1 and plain.tail is None and plain.splits == 1   # unsplit: kept (46.2 us against 43.6)
    assert t < 0.97 * gemm_modelled_us(plain, 512, 4096, 6144, "float16", 132, one)
    # forced two streams (ksplit=2) take the modelled tail with the switch on, whatever the one-stream plan
    assert plan_gemm(512, 4096, 6144, 128, wgmma=True, resident=132, ksplit=2) == p
    # Llama-2-70B qkv at M = 256: three one-stream splits (80 x 3 CTAs) become 132 two-stream CTAs and a tail
    q = plan_gemm(256, 8192, 10240, 128, wgmma=True, resident=132)
    assert (q.ksplit, q.grid, q.tail.splits) == (2, (132, 1, 1), 4), q
    assert plan_gemm(256, 8192, 10240, 128, wgmma=True, resident=132, tail=False).tail is None
    assert plan_gemm(256, 8192, 10240, 128, wgmma=True, resident=132, batch_invariant=True).tail is None
    monkeypatch.setattr(plans, "_KSPLIT_TMA_TAILS", False)   # off: forced two streams and the measured wins
    assert plan_gemm(512, 4096, 6144, 128, wgmma=True, resident=132, ksplit=2).tail is None
    for K, N, M in ((14336, 4096, 768), (8192, 10240, 256)):   # back to their split plans
        r = plan_gemm(M, K, N, 128, wgmma=True, resident=132)
        assert r.tail is None and r.splits > 1, r


def test_pair_grid_tail_models_a_lone_last_round(monkeypatch):
    """Two CTAs per SM (the 128-token tile's PEND 2) beyond one wave: pairs at the tensor cores' bound, a last
    round of one CTA per SM at plans._PAIR_LONE of a pair's unit. Llama-2-70B gate_up at M = 128: the one launch is
    two rounds of pairs (448 tiles on 264 slots); the planned tail splits the last 184 tiles two ways, 368 CTAs: a
    round of pairs, then 104 alone. Planned only with plans.PAIR_TAILS on (the default), and then on no other
    benchmark layer or M of the tail test's list than _TAILS has."""
    from awq_cupy.bench import MODELS
    from awq_cupy.plans import _PAIR_LONE, pair_sm_terms, plan_gemm_launch, split_cost, tail_split_cost

    arch = jit.ARCHS["90"]
    assert plans.PAIR_TAILS
    with monkeypatch.context() as m:   # the switch off: the one launch, as the co-residence model priced it
        m.setattr(plans, "PAIR_TAILS", False)
        assert plan_gemm_launch(128, 8192, 57344, 128, "bfloat16", arch, 132, h200_resident).tail is None
    for model, layers in MODELS.items():
        for name, K, N in layers:
            for M in (64, 100, 128, 256, 512, 1024, 2048, 4096):
                for dtype in ("float16", "bfloat16"):
                    p = plan_gemm_launch(M, K, N, 128, dtype, arch, 132, h200_resident)
                    got = (p.pend, p.grid[0], p.tail.splits, p.tail.per) if p.tail is not None else None
                    if (name, M) in (("gate_up", 100), ("gate_up", 128)) and model == "llama-2-70b":
                        assert got == (2, 264, 2, 64), (model, name, M, p)
                    else:   # as without the terms (_TAILS)
                        want = _TAILS.get((model, name, K, N, M))
                        ok = got is not None and (got[1], got[2]) == want if want else got is None
                        assert ok, (model, name, M, p)

    terms = pair_sm_terms(16, 1, 1, 2)
    assert terms == pytest.approx(dict(tensor_us=0.39, lone=_PAIR_LONE))
    assert pair_sm_terms(32, 1, 1, 1) == {}    # one CTA per SM: the co-residence model as it was
    with monkeypatch.context() as m:
        m.setattr(plans, "PAIR_TAILS", False)
        assert pair_sm_terms(16, 1, 1, 2) == {}
    kw = dict(resident=264, M=128, Np=57344, stage_us=0.5, min_per=2, per_sm=2, share=0.1, **terms)
    assert split_cost(128, 448, 1, **kw)[0] == pytest.approx(2 * 128 * 0.78)
    t, first, splits, per = tail_split_cost(128, 448, 1, cols_per_tile=128, **kw)
    assert (first, splits, per) == (264, 2, 64)
    partials = 2 * 128 * (184 * 128) * 8 / 4e6
    assert t == pytest.approx((128 + 64) * 0.78 + 64 * _PAIR_LONE * 0.78 + partials + 4.0 + 1.0)
    # measured (H200, bf16 and fp16 alike): 194.1 against 202.0 us; 3, 4, 5, 7 splits 205.6, 201.4, 204.2, 215.5
    assert t < 0.98 * split_cost(128, 448, 1, **kw)[0]
    # a grid of one CTA per SM runs at the lone rate too (0.55 of a full SM's 0.78 us); without lone the
    # co-residence model's
    assert split_cost(128, 100, 1, **kw)[0] == pytest.approx(128 * _PAIR_LONE * 0.78)
    assert split_cost(128, 100, 1, **dict(kw, lone=0.0))[0] == pytest.approx(128 * 0.5)
    assert split_cost(128, 100, 1, **dict(kw, per_sm=1, resident=132))[0] == pytest.approx(128 * 0.5)   # no pairs


def test_tail_split_cost_models_whole_waves_then_one_split_wave():
    from awq_cupy.plans import tail_split_cost

    kw = dict(resident=132, M=256, Np=57344, stage_us=0.78, min_per=2, per_sm=1, share=0.1, cols_per_tile=128)
    t, first, splits, per = tail_split_cost(128, 448, 1, **kw)
    assert (first, splits, per) == (396, 2, 64)           # 3 waves, then 52 tiles x 2 splits in one wave
    partials = 2 * 256 * (52 * 128) * 8 / 4e6             # written and read at 4 TB/s
    assert t == pytest.approx((3 * 128 + 64) * 0.78 + partials + 4.0 + 1.0)   # + the reduce and the second start
    assert tail_split_cost(128, 132, 1, **kw)[1] == 0       # exactly one wave
    assert tail_split_cost(128, 100, 1, **kw)[1] == 0       # less than one


# Benchmark layers whose M rows matmul runs as two calls (plans.row_split) on the H200 (132 SMs, h200_resident),
# over M values past whole 256-token tiles: the model's choices the sweep of
# bench/sweeps/token_tiles.py was checked against (docs/design.md §Row split). Mistral-7B qkv at 640 runs one call
# with a split tail instead (67.0 us, against 70.1 for the row split: h200_tail_vs_ksplit_v47.txt)
_ROW_SPLITS = {("mistral-7b", "qkv"): (257, 300, 320, 384), ("mistral-7b", "o"): (640, 1100),
               ("mistral-7b", "gate_up"): (257, 300, 320, 384, 640, 1100), ("mistral-7b", "down"): (257, 300, 320, 640),
               ("llama-2-70b", "qkv"): (257, 300, 320, 384), ("llama-2-70b", "o"): (257, 300, 320, 640),
               ("llama-2-70b", "gate_up"): (257, 300, 320, 384, 640),
               ("llama-2-70b", "down"): (257, 300, 320, 384, 640)}


def test_row_split_where_the_last_token_tile_is_mostly_padding():
    from awq_cupy import jit
    from awq_cupy.bench import MODELS
    from awq_cupy.plans import row_split

    arch = jit.ARCHS["90"]
    for model, layers in MODELS.items():
        for name, K, N in layers:
            for dtype in ("float16", "bfloat16"):
                got = tuple(M for M in (257, 300, 320, 384, 448, 640, 768, 1100, 1280, 1536)
                            if row_split(M, K, N, 128, dtype, arch, 132, h200_resident))
                assert got == _ROW_SPLITS[(model, name)], (model, name, dtype)
            assert row_split(300, K, N, 128, "float16", arch, 132, h200_resident) in (0, 256)
            assert row_split(1100, K, N, 128, "float16", arch, 132, h200_resident) in (0, 1024)
            for M in (16, 200, 256, 512, 4096):   # one token tile or whole ones: nothing to split off
                assert row_split(M, K, N, 128, "float16", arch, 132, h200_resident) == 0
            # no wgmma GEMM (sm_80; or only past its largest tile): one call
            assert row_split(300, K, N, 128, "float16", jit.ARCHS["80"], 108, h200_resident) == 0


def test_split_cost_bounds_co_resident_ctas_by_their_tensor_work():
    from awq_cupy.plans import split_cost

    # 224 CTAs of the 128-token tile, two per SM (Mistral-7B gate_up at M = 128): the 0.5 us floor x 1.1 for two
    # sharing an SM, unless their tensor work (0.39 us each, 0.78 for the two) is longer
    kw = dict(resident=264, M=128, Np=28672, stage_us=0.5, min_per=64, per_sm=2, share=0.1)
    assert split_cost(64, 224, 1, **kw)[0] == pytest.approx(64 * 0.55)
    assert split_cost(64, 224, 1, tensor_us=0.39, **kw)[0] == pytest.approx(64 * 0.78)
    assert split_cost(64, 100, 1, tensor_us=0.39, **kw)[0] == pytest.approx(64 * 0.5)   # one CTA per SM: floor


def test_forced_token_tile():
    p = plan_gemm(300, 4096, 6144, 128, wgmma=True, token_tile=128)
    assert (p.token_blocks, p.grid[2]) == (16, 3)
    assert plan_gemm(300, 4096, 6144, 128, wgmma=True).grid[2] == 2
    with pytest.raises(ValueError, match=r"token_tile=96: the wgmma GEMM's token tiles are \[16, 32, 64, 128, 256\]"):
        plan_gemm(300, 4096, 6144, 128, wgmma=True, token_tile=96)


def test_plan_gemm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="splits=0 must be 1 to 64"):
        plan_gemm(64, 4096, 4096, 128, splits=0)
    with pytest.raises(ValueError, match="tiles=3 is not a GEMM variant"):
        plan_gemm(64, 4096, 4096, 128, tiles=3)
    with pytest.raises(ValueError, match="M=0"):
        plan_gemm(0, 4096, 4096, 128)
    with pytest.raises(ValueError, match="tiles=1, depth=99 is not a GEMM variant"):
        plan_gemm(64, 4096, 4096, 128, tiles=1, depth=99)


@pytest.mark.parametrize("wgmma", [False, True])
def test_gemm_shape_for_picks_the_depth_asked_for(wgmma):
    for nb, tw, depth in kernels.GEMM_WG_SHAPES if wgmma else kernels.GEMM_SHAPES:
        assert gemm_shape_for(8 * nb, tw, wgmma=wgmma, depth=depth) == (nb, tw, depth)
        assert plan_gemm(8 * nb, 4096, 4096, 128, wgmma=wgmma, tiles=tw, depth=depth).depth == depth


def test_wgmma_two_per_sm_variant_only_for_grids_larger_than_the_sms():
    from awq_cupy.plans import wgmma_pend

    for shape, pend in kernels.GEMM_WG_PEND_TWO_PER_SM.items():
        assert shape in kernels.GEMM_WG_SHAPES and pend != kernels.gemm_wg_pend(shape[0])
        assert wgmma_pend(shape, 133, 132) == pend and wgmma_pend(list(shape), 1000, 132) == pend
        assert wgmma_pend(shape, 132, 132) is None and wgmma_pend(shape, 1, 132) is None
        assert wgmma_pend(shape, 1000, 132, batch_invariant=True) is None
        assert wgmma_pend(shape, None, 132) == pend and wgmma_pend(shape, None, 132, batch_invariant=True) is None
        # Mistral-7B at M = 128 (docs/history.md v20): gate_up's default grid (224 CTAs) takes it, o's (128) does not
        gu = plan_gemm(128, 4096, 28672, 128, wgmma=True, tiles=shape[1], depth=shape[2])
        o = plan_gemm(128, 4096, 4096, 128, wgmma=True, tiles=shape[1], depth=shape[2])
        assert wgmma_pend(shape, math.prod(gu.grid), 132) == pend
        assert wgmma_pend(shape, math.prod(o.grid), 132) is None
    for shape in kernels.GEMM_WG_SHAPES:
        if shape not in kernels.GEMM_WG_PEND_TWO_PER_SM:
            assert wgmma_pend(shape, 10_000, 132) is None and wgmma_pend(shape, None, 132) is None


@pytest.mark.parametrize("own_grid", [False, True])
def test_pend_two_where_its_own_planned_grid_fills_two_ctas_per_sm(monkeypatch, own_grid):
    """plans.PEND_TWO_OWN_GRID: the 128-token tile's PEND 2 variant also where only its own split plan (planned for
    two CTAs per SM) has more CTAs than SMs; off, only where the default PEND's grid has."""
    from awq_cupy import jit, plans

    monkeypatch.setattr(plans, "PEND_TWO_OWN_GRID", own_grid)

    def res(v, smem):
        return 2 if v.token_blocks < 16 or v.pend == 2 else 1

    def plan(M, K, N, **kw):
        return plans.plan_gemm_launch(M, K, N, 128, "float16", jit.ARCHS["90"], 132, res, **kw)

    down = plan(128, 28672, 8192)   # Llama-2-70B down: 64 column tiles x 2 splits at the default PEND
    assert (down.pend, down.grid) == ((2, (64, 4, 1)) if own_grid else (None, (64, 2, 1)))
    assert plan(128, 4096, 4096).pend is None          # Mistral-7B o: 128 CTAs either way, one per SM
    # Mistral-7B at M = 96: down's PEND 2 plan keeps 28 units per split (taken), o's 8 (too short: not taken)
    down96 = plan(96, 14336, 4096)
    assert (down96.pend, down96.per) == ((2, 28) if own_grid else (None, 56))
    assert plan(96, 4096, 4096).pend is None
    assert plans.plan_gemm_launch(96, 4096, 4096, 128, "float16", jit.ARCHS["90"], 132, lambda v, smem: 2,
                                  pend=2).per < plans._PEND_TWO_MIN_UNITS   # its PEND 2 plan: 8 splits of 8
    assert plan(128, 8192, 57344).pend == 2            # Llama-2-70B gate_up: 448 CTAs at the default PEND
    assert plan(128, 28672, 8192, batch_invariant=True).pend is None
    assert plan(128, 28672, 8192, pend=3).pend == 3    # a forced PEND is kept
    assert plan(128, 28672, 8192, splits=2).pend is None   # forced splits: the PEND 2 grid is the default's
    # the row split models its rest without it (Mistral-7B down and Llama-2-70B o at M = 384: one call either way)
    for K, N in ((14336, 4096), (8192, 8192)):
        assert plans.row_split(384, K, N, 128, "float16", jit.ARCHS["90"], 132, res) == 0


def test_wgmma_variant_names_and_the_kernels_pend_default():
    """Python's PEND default per token tile mirrors the kernel's template default; a non-default PEND is named."""
    import re

    from awq_cupy.jit import read_source

    m = re.search(r"int PEND = \(NB >= (\d+) \? (\d) : (\d)\)", read_source("gemm_wg.cu"))
    assert m, "PEND default of awq_gemm_wg_kernel"
    for nb in (2, 4, 8, 16, 32):
        assert kernels.gemm_wg_pend(nb) == int(m.group(2) if nb >= int(m.group(1)) else m.group(3))
        v = kernels.WgmmaVariant("float16", nb, 1, 4, True)
        assert v == kernels.WgmmaVariant("float16", nb, 1, 4, True, kernels.gemm_wg_pend(nb))
        other = kernels.WgmmaVariant("float16", nb, 1, 4, True, 2 if nb >= 16 else 3)
        assert v.expr.count(",") == 4 and other != v and other.expr.count(",") == 5
        two = kernels.WgmmaVariant("float16", nb, 1, 4, True, ksplit=2)
        assert two.expr.endswith(f", {kernels.gemm_wg_pend(nb)}, 2>")
    from awq_cupy.jit import ARCHS

    names = kernels.GEMM_WG.names(ARCHS["90a"])
    assert len(names) == len(set(names))
    for (nb, tw, depth), pend in kernels.GEMM_WG_PEND_TWO_PER_SM.items():
        assert kernels.WgmmaVariant("bfloat16", nb, tw, depth, False, pend).expr in names


def test_launch_constants_match_the_kernel_sources():
    """The launch sizes threads and shared memory from Python mirrors of the kernels' constants."""
    import re

    from awq_cupy.jit import read_source

    for name in ("gemm_tc.cu", "gemm_wg.cu"):
        assert re.search(rf"constexpr int WARPS = {kernels.GEMM_WARPS};", read_source(name)), name
    assert re.search(rf"constexpr int SLOTS = {kernels.GEMM_WG_SLOTS};", read_source("gemm_wg.cu"))


def test_wgmma_smem_fits_the_h200_and_sm90_dispatch_uses_the_fused_gemm_up_to_768():
    from awq_cupy import dispatch
    from awq_cupy.jit import ARCHS

    for nb, _, _ in kernels.GEMM_WG_SHAPES:   # slots + alignment + the mbarriers, within 227 KB per block
        smem = kernels.WgmmaVariant("float16", nb, 1, 4, True).smem_bytes
        assert smem + 8 * kernels.GEMM_WG_SLOTS <= ARCHS["90a"].smem_optin
    row = dispatch.TABLE["90"]
    # the v14 tune: wgmma GEMM from the 32-token tile; dequantize + cuBLAS considered from 768 (v20 tune)
    assert row.gemv_max_m < row.wgmma_min_m <= 32 and 256 <= row.cublas_min_m <= 1024


# (model, layer, M) -> the faster path from the row's cublas_min_m (768) on, with (fused wgmma GEMM, dequantize +
# cuBLAS) in us where it was measured against today's kernels: the v54 sweep on an H100
# (bench/results/h100_fused_vs_dense_v54.json, `bench --contenders gemm_wg dequant_cublas`), where the fused GEMM
# won all 56 cells of both models at M = 768..4096; its closest cells are listed. Entries without times: the v20
# tune and the v47 sweep on the H200 (bench/results/h200_tune_v20.txt, h200_token_tiles_v47.txt) where they agree.
_MEASURED = {("mistral-7b", "gate_up", 4096): ("fused", 1326.6, 1377.9),
             ("mistral-7b", "o", 1536): ("fused", 80.3, 87.9), ("mistral-7b", "o", 2560): ("fused", 126.1, 129.3),
             ("mistral-7b", "qkv", 3072): ("fused", 219.2, 227.8), ("mistral-7b", "qkv", 4096): ("fused", 280.6, 292.7),
             ("mistral-7b", "down", 4096): ("fused", 626.2, 664.8), ("mistral-7b", "o", 4096): ("fused", 186.6, 198.2),
             ("llama-2-70b", "gate_up", 4096): ("fused", 5514.0, 5851.9),
             ("llama-2-70b", "o", 4096): ("fused", 733.4, 770.0), ("llama-2-70b", "qkv", 4096): ("fused", 921.3, 972.9),
             ("llama-2-70b", "down", 4096): ("fused", 2578.6, 2730.4),
             ("mistral-7b", "o", 768): ("fused",), ("mistral-7b", "o", 1024): ("fused",),
             ("mistral-7b", "gate_up", 768): ("fused",), ("mistral-7b", "gate_up", 1024): ("fused",),
             ("mistral-7b", "down", 768): ("fused",), ("mistral-7b", "down", 1024): ("fused",),
             ("mistral-7b", "down", 1280): ("fused",), ("llama-2-70b", "qkv", 1280): ("fused",),
             ("llama-2-70b", "o", 1280): ("fused",)}


def test_sm90_cost_model_picks_the_measured_winner_per_layer():
    from awq_cupy.jit import ARCHS
    from awq_cupy.plans import cublas_beats_fused

    from awq_cupy.bench import MODELS

    for (model, layer, M), (best, *times) in _MEASURED.items():
        assert not times or (times[0] < times[1]) == (best == "fused"), (model, layer, M)
        K, N = next((k, n) for name, k, n in MODELS[model] if name == layer)
        assert cublas_beats_fused(M, K, N, ARCHS["90"]) == (best == "cublas"), (layer, M)
        assert uses_cublas(M, "float16", K=K, N=N) == (best == "cublas"), (layer, M)
    # M = 1100 (four whole 256-token tiles and 76 rows): where the row split's two calls model below dequantize +
    # cuBLAS, the fused GEMM. H200 (bench/results/h200_token_tiles_after_v47.txt), fused one call / row split /
    # dequantize + cuBLAS in us: Llama-2-70B down 771.4 / 743.0 / 846.8, o 237.9 / 229.4 / 247.9, qkv 296.8 /
    # 294.2 / 308.5 (its 5 x 79 tiles with a split tail launch)
    for K, N in ((28672, 8192), (8192, 8192), (8192, 10240)):
        assert not cublas_beats_fused(1100, K, N, ARCHS["90"]), (K, N)
    # the fused GEMM timed as it is planned: two K streams where x goes through the tensor map and plan_gemm takes
    # them (Mistral-7B o at M = 4608: 64 x 18 narrower CTAs instead of 32 x 18 whole ones in 4.36 waves)
    assert plan_gemm(4608, 4096, 4096, 128, wgmma=True, resident=132).ksplit == 2
    assert not cublas_beats_fused(4608, 4096, 4096, ARCHS["90"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plans, "_KSPLIT_TMA", False)
        assert cublas_beats_fused(4608, 4096, 4096, ARCHS["90"])     # the one-stream model gave it to cuBLAS
    # below cublas_min_m, without wgmma (no model for the mma.sync GEMM) and for bf16: the table's threshold
    row = dispatch.TABLE["90"]
    assert not cublas_beats_fused(row.cublas_min_m - 1, 4096, 6144, ARCHS["90"])
    assert cublas_beats_fused(row.cublas_min_m, 4096, 28672, ARCHS["89"]) == (
        row.cublas_min_m >= dispatch.TABLE["default"].cublas_min_m)
    assert not uses_cublas(4096, "bfloat16", K=4096, N=6144)
    d = dispatch.TABLE["default"]   # a key without an Arch: the threshold
    assert uses_cublas(d.cublas_min_m, "float16", "default", K=4096, N=6144)
    assert not uses_cublas(d.cublas_min_m - 1, "float16", "default", K=4096, N=6144)


def test_cost_model_fields_are_validated():
    good = dict(gemv_max_m=16, cublas_min_m=512, wgmma_min_m=17)
    for bad in (dict(fused_unit_us=0.9), dict(fused_unit_us=0.9, dequant_tbps=3.0, cublas_tflops=-1.0),
                dict(fused_unit_us=True, dequant_tbps=3.0, cublas_tflops=700.0)):
        with pytest.raises(ValueError, match="all three positive numbers, or none"):
            dispatch.Dispatch(**good, **bad)
    model = dict(fused_unit_us=0.9, dequant_tbps=3.0, cublas_tflops=700.0)
    with pytest.raises(ValueError, match="cublas_min_m >= 256"):
        dispatch.Dispatch(gemv_max_m=16, cublas_min_m=128, wgmma_min_m=17, **model)
    with pytest.raises(ValueError, match="needs the wgmma GEMM"):
        dispatch.Dispatch(gemv_max_m=16, cublas_min_m=512, wgmma_min_m=None, **model)
    assert dispatch.Dispatch(**good, **model).has_cost_model and not dispatch.Dispatch(**good).has_cost_model


def test_tuned_row_without_cost_model_fields_takes_the_builtin_ones(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text('{"table": {"90": {"gemv_max_m": 8, "cublas_min_m": 1024, "wgmma_min_m": 17}}}')
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.reload()
    row = dispatch.for_arch("90")
    assert row.cublas_min_m == 1024 and row.fused_unit_us == dispatch.TABLE["90"].fused_unit_us
    dispatch.reload()


def test_wgmma_only_on_compute_capability_9_and_from_the_tables_m(monkeypatch):
    from awq_cupy import jit
    from awq_cupy.plans import has_wgmma, uses_wgmma

    first = dispatch.for_arch("90").wgmma_min_m
    assert first is not None
    assert has_wgmma(jit.ARCHS["90"]) and not has_wgmma(jit.ARCHS["89"]) and not has_wgmma(jit.ARCHS["80"])
    assert uses_wgmma(jit.ARCHS["90"]) and not uses_wgmma(jit.ARCHS["89"]) and not uses_wgmma(jit.ARCHS["80"], 128)
    assert uses_wgmma(jit.ARCHS["90"], first) and not uses_wgmma(jit.ARCHS["90"], first - 1)
    monkeypatch.setenv("AWQ_CUPY_WGMMA", "0")
    settings.reload()
    assert not has_wgmma(jit.ARCHS["90"]) and not uses_wgmma(jit.ARCHS["90"], 128)


def test_table_without_wgmma_row_means_never(tmp_path, monkeypatch):
    from awq_cupy import jit
    from awq_cupy.plans import uses_wgmma

    path = tmp_path / "t.json"
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", str(path))
    settings.reload()
    dispatch.write_table(path, {"90": dispatch.Dispatch(gemv_max_m=8, cublas_min_m=256, wgmma_min_m=None)}, {})
    assert not uses_wgmma(jit.ARCHS["90"], 128) and not uses_wgmma(jit.ARCHS["90"])
    dispatch.reload()


def test_dispatch_table_is_consistent():
    for key, d in dispatch.TABLE.items():
        assert 1 <= d.gemv_max_m <= 8 * max(kernels.GEMV_TOKEN_BLOCKS), key
        assert d.cublas_min_m > d.gemv_max_m, key
    assert dispatch.for_arch("does-not-exist") == dispatch.TABLE["default"]
    d = dispatch.for_arch("90")
    assert not rounds_weights(d.gemv_max_m) and rounds_weights(d.gemv_max_m + 1)
    assert rounds_weights(1, batch_invariant=True)
    # at GEMV sizes it depends on the plan: the pairs at two token blocks multiply by the rounded weights
    down = dict(K=14336, N=4096, group_size=128)
    assert rounds_weights(16, **down) and rounds_weights(9, **down, dtype="bfloat16")
    assert not rounds_weights(8, **down) and not rounds_weights(16, K=4096, N=28672, group_size=128)
    assert not rounds_weights(16)                     # no shape: the other variants' answer
    # beyond 16 rows: the GEMV's exact (q - z) where gemv_wide_takes gives it the layer, else the GEMM's rounding
    gate_up = dict(K=4096, N=28672, group_size=128)
    assert not rounds_weights(24, **gate_up) and rounds_weights(25, **gate_up) and rounds_weights(24, **down)
    assert not rounds_weights(32, K=4096, N=6144, group_size=128) and rounds_weights(33, K=4096, N=6144)
    assert rounds_weights(24) and rounds_weights(24, **gate_up, batch_invariant=True)
    assert uses_cublas(d.cublas_min_m, "float16") and not uses_cublas(d.cublas_min_m - 1, "float16")
    assert not uses_cublas(10**6, "bfloat16") and not uses_cublas(10**6, "float16", batch_invariant=True)


def test_gemv_args_follow_the_kernel_signature():
    """launch.gemv_args (the GEMV launch and bench/probes/gemv_trace.py) passes awq_gemv_tc_kernel's parameters in order:
    x, qtiles, scales, zeros, bias, y, M, N, K, NT16, KS, G, NG, Np, then the four fastdiv dividers."""
    import types

    import numpy as np

    w = types.SimpleNamespace(qtiles="q", scales="s", zeros="z", N=4096, K=14336, KS=224, group_size=128, NG=112,
                              NT=64)
    p = plan_gemv(3, 14336, 4096, 128)
    args = gemv_args("x", w, "b", "y", 3, p)
    assert args[:6] == ("x", "q", "s", "z", "b", "y")
    assert all(isinstance(a, np.int32) for a in args[6:14]) and all(isinstance(a, np.uint64) for a in args[14:])
    assert [int(a) for a in args[6:14]] == [3, 4096, 14336, p.NT16, 224, 128, 112, 64 * 64]
    assert args[14:] == gemv_dividers(p.grid, p.NT16, p.warps, 224, 128, p.kdepth)
    assert p.kdepth == 2 and int(args[16]) == int(fastdiv(112))   # by units per column group: 224 blocks / 2


@pytest.mark.parametrize("M,K,N,G", [(1, 4096, 28672, 128), (16, 14336, 4096, 128), (3, 1088, 4160, 64),
                                     (9, 2112, 2000, 32), (1, 1000, 4200, -1)])
def test_gemv_shape_family_defines_the_launch_arguments(M, K, N, G):
    """A GEMV compiled for its launch shape takes as constants exactly the values gemv_args passes after M (the
    kernel ignores those arguments then), under the kernel's names; with ``tokens`` M too (AWQ_GEMV_M), 1 to 8 per
    token block of the variant."""
    import types

    from awq_cupy import kernels
    from awq_cupy.formats import resolve_group_size
    from awq_cupy.layout import padded_sizes
    from awq_cupy.plans import gemv_shape_args

    G = resolve_group_size(G, K)
    Kp, Np = padded_sizes(K, N)
    w = types.SimpleNamespace(qtiles="q", scales="s", zeros="z", N=N, K=K, KS=Kp // 64, group_size=G,
                              NG=max(1, K // G), NT=Np // 64)
    for warps in (None, 3):
        p = plan_gemv(M, K, N, G, warps=warps)
        shape = gemv_shape_args(w, p)
        assert gemv_args("x", w, "b", "y", M, p)[7:] == shape == gemv_args("x", w, "b", "y", M, p, shape)[7:]
        v = p.variant("float16")
        fam = kernels.gemv_shape_family(v, shape, p.warps)
        d = dict(fam.defines)
        assert d["AWQ_GEMV_SHAPE"] == "1" and d["AWQ_GEMV_W"] == str(p.warps) and "AWQ_GEMV_M" not in d
        assert [d[f"AWQ_GEMV_{n}"] for n in kernels.GEMV_SHAPE_ARGS] == [
            f"{int(c)}ull" if n.startswith("FD_") else str(int(c)) for n, c in zip(kernels.GEMV_SHAPE_ARGS, shape)]
        assert fam.variants(None) == (v,) and fam.source == kernels.GEMV_TC.source
        assert kernels.gemv_shape_family(v, tuple(int(c) for c in shape), p.warps) is fam   # one per shape
        other = kernels.gemv_shape_family(v, shape[:-1] + (int(shape[-1]) + 1,), p.warps)
        assert other.name != fam.name
        one = kernels.gemv_shape_family(v, shape, p.warps, tokens=1)
        assert dict(one.defines)["AWQ_GEMV_M"] == "1" and one.name != fam.name
        assert kernels.gemv_shape_family(v, shape, p.warps, tokens=8 * p.token_blocks) is not one
        for bad in (0, 8 * p.token_blocks + 1):
            with pytest.raises(ValueError, match=f"tokens={bad}"):
                kernels.gemv_shape_family(v, shape, p.warps, tokens=bad)
    with pytest.raises(ValueError, match="11 arguments"):
        kernels.gemv_shape_family(v, shape[:-1], 4)


def test_gemv_specializes_on_sm90_for_model_sized_weights(monkeypatch):
    """Shape-compiled GEMVs: compute capability 9.0 only, from GEMV_SHAPE_MIN_WEIGHTS weights (auto), at any size
    with AWQ_CUPY_GEMV_SHAPES=1, never with 0; another value is a clear error."""
    from awq_cupy import jit
    from awq_cupy.plans import GEMV_SHAPE_MIN_WEIGHTS, gemv_specializes

    h100, a100 = jit.ARCHS["90"], jit.ARCHS["80"]
    monkeypatch.delenv("AWQ_CUPY_GEMV_SHAPES", raising=False)
    settings.reload()
    assert gemv_specializes(h100, 4096, 4096) and gemv_specializes(h100, 4096, GEMV_SHAPE_MIN_WEIGHTS // 4096)
    assert not gemv_specializes(h100, 4096, GEMV_SHAPE_MIN_WEIGHTS // 4096 - 1)
    assert not gemv_specializes(a100, 4096, 28672)
    monkeypatch.setenv("AWQ_CUPY_GEMV_SHAPES", "1")
    settings.reload()
    assert gemv_specializes(h100, 64, 16) and not gemv_specializes(a100, 4096, 28672)
    monkeypatch.setenv("AWQ_CUPY_GEMV_SHAPES", "0")
    settings.reload()
    assert not gemv_specializes(h100, 4096, 28672)
    monkeypatch.setenv("AWQ_CUPY_GEMV_SHAPES", "yes")
    with pytest.raises(ValueError, match="AWQ_CUPY_GEMV_SHAPES='yes'"):
        settings.reload()
    with pytest.raises(ValueError, match="AWQ_CUPY_GEMV_SHAPES='yes'"):
        gemv_specializes(h100, 4096, 4096)


def test_gemv_kernel_compiles_per_launch_shape_and_token_count(monkeypatch):
    """launch.gemv_kernel (matmul's choice, no GPU needed to check it): on compute capability 9.0 a model-sized weight
    gets a kernel compiled for its launch arguments (gemv_shape_args), one more for M = 16 (and for M = 1 from
    GEMV_M1_MIN_WEIGHTS elements: gemv_compiled_tokens), one per (shape, token count) and cached; a small weight,
    another arch or a capture take the generic variant, which is loaded first as a capture's fallback."""
    import types

    from awq_cupy import jit, kernels, launch, plans

    big = plans.GEMV_M1_MIN_WEIGHTS
    assert [plans.gemv_compiled_tokens(M, 8192, big // 8192) for M in (1, 2, 8, 15, 16)] == [1, None, None, None, 16]
    assert [plans.gemv_compiled_tokens(M, 4096, big // 4096 - 1) for M in (1, 16)] == [None, 16]
    loaded = []
    monkeypatch.setattr(kernels, "get_kernel", lambda fam, v, dev=None: loaded.append((fam, v)) or (fam.name, v))
    monkeypatch.setattr(kernels, "kernel", lambda v, dev=None: loaded.append((v.family, v)) or (v.family, v))
    monkeypatch.setattr(launch, "_gemv_shape_kernels", {})
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    monkeypatch.delenv("AWQ_CUPY_GEMV_SHAPES", raising=False)
    settings.reload()
    h100 = jit.ARCHS["90"]
    K, N = 4096, 6144
    w = types.SimpleNamespace(N=N, K=K, KS=K // 64, group_size=128, NG=K // 128, NT=N // 64, device=0)
    names = {}
    for M in (1, 2, 16, 12, 1, 16):
        p = plan_gemv(M, K, N, 128, arch=h100)
        before = len(loaded)
        names[M] = launch.gemv_kernel(w, p, "float16", h100, M)[0]
        if len(loaded) > before:   # a first build: the generic variant, then the shape's kernel
            v = p.variant("float16")
            assert loaded[before] == ("gemv_tc", v) and len(loaded) == before + 2
            d = dict(loaded[-1][0].defines)
            assert [d[f"AWQ_GEMV_{n}"].rstrip("ul") for n in kernels.GEMV_SHAPE_ARGS] == [
                str(int(a)) for a in plans.gemv_shape_args(w, p)]
            assert d.get("AWQ_GEMV_M") == ("16" if M == 16 else None), (M, d)
    assert len(loaded) == 6 and len(launch._gemv_shape_kernels) == 3    # M = 1 (also M = 2), 12, 16: once each
    assert names[1] == names[2] and names[12] != names[16] and names[16].startswith("gemv_tc:")
    assert names[16].endswith(":m16") and not names[12].endswith(":m16")
    small = types.SimpleNamespace(N=64, K=128, KS=2, group_size=128, NG=1, NT=1, device=0)
    p = plan_gemv(1, 128, 64, 128, arch=h100)
    assert launch.gemv_kernel(small, p, "float16", h100, 1)[0] == "gemv_tc"
    assert launch.gemv_kernel(w, plan_gemv(1, K, N, 128, arch=jit.ARCHS["80"]), "float16", jit.ARCHS["80"], 1)[0] \
        == "gemv_tc"
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    p = plan_gemv(4, K, N, 128, arch=h100)
    assert launch.gemv_kernel(w, p, "float16", h100, 4)[0] == names[1]            # M = 1's launch shape, built
    w2 = types.SimpleNamespace(**{**vars(w), "N": 4096, "NT": 64})
    p = plan_gemv(16, K, 4096, 128, arch=h100)
    assert launch.gemv_kernel(w2, p, "float16", h100, 16)[0] == "gemv_tc"         # not built yet: the fallback
    assert launch.gemv_kernel(w, plan_gemv(16, K, N, 128, arch=h100), "float16", h100, 16)[0] == names[16]
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    w3 = types.SimpleNamespace(**{**vars(w), "N": 8192, "NT": 128, "K": 8192, "KS": 128, "NG": 64})   # 2^26 weights
    n1 = launch.gemv_kernel(w3, plan_gemv(1, 8192, 8192, 128, arch=h100), "float16", h100, 1)[0]
    assert n1.endswith(":m1") and dict(loaded[-1][0].defines)["AWQ_GEMV_M"] == "1"


def test_x_tile_chunks_counts_the_tiles_and_refuses_what_32_bit_indices_cannot_hold():
    """plans.x_tile_chunks: ceil(M / BM) token tiles x ceil(K / 64) units x BM rows x 8 chunks, also past 2^31
    chunks (awq_tile_x_kernel's loop index is 64-bit); a ValueError naming the rows and K from 2^31 (token tile,
    unit) pairs on (its 32-bit multiply-shift division), and for a token tile that is not a power of two."""
    from awq_cupy.plans import x_tile_chunks

    assert x_tile_chunks(1, 64, 16) == 16 * 8
    assert x_tile_chunks(17, 4096, 32) == 1 * 64 * 32 * 8
    assert x_tile_chunks(300, 1000, 256) == 2 * 16 * 256 * 8          # K % 64 != 0: its last unit counts
    assert x_tile_chunks(2**20, 8192, 256) == 2**12 * 128 * 256 * 8   # 2^30 chunks: fine
    assert x_tile_chunks(2**22, 2**15, 16) == 2**18 * 2**9 * 16 * 8    # 2^27 pairs, 2^34 chunks: fine
    with pytest.raises(ValueError, match=r"x has \d+ rows of K=65536.*2\^31"):
        x_tile_chunks(2**26, 2**16, 16)                                # 2^32 pairs
    with pytest.raises(ValueError, match="power of two"):
        x_tile_chunks(100, 64, 24)


def test_x_by_tensor_map_where_measured():
    """The tensor-map GEMM (no x tile pass) is planned on whole 256-token tiles of layers up to X_TMA_MAX_N columns
    (H100 A/B, docs/design.md §wgmma GEMM (gemm_wg)); not on a partial tile, the 128-token tile, wide layers or
    batch-invariant calls; plan_gemm_launch takes it there and runs that variant, and tma=True is refused where no
    variant exists."""
    from awq_cupy.jit import ARCHS

    arch = ARCHS["90"]
    t256, t128, t64 = (32, 1, 4), (16, 1, 4), (8, 1, 6)
    assert plans.x_by_tensor_map(256, 6144, t256) and plans.x_by_tensor_map(4096, 16384, t256)
    assert not plans.x_by_tensor_map(4096, 16392, t256)          # wide: the pass is spread over many tiles
    assert not plans.x_by_tensor_map(192, 6144, t256)            # the tile runs past M
    assert not plans.x_by_tensor_map(300, 6144, t256) and not plans.x_by_tensor_map(128, 4096, t128)
    assert not plans.x_by_tensor_map(512, 4096, t256, batch_invariant=True)
    assert not plans.x_by_tensor_map(512, 4096, t64)             # no tensor-map variant
    res = lambda v, smem: 1   # noqa: E731
    for M, N, want in ((512, 4096, True), (1024, 28672, False), (192, 4096, False), (64, 4096, False)):
        p = plans.plan_gemm_launch(M, 4096, N, 128, "float16", arch, 132, res, wgmma=True)
        assert p.tma == want and p.variant("float16").tma == want, (M, N, p)
        assert ("awq_gemm_wg_tma_kernel" in p.variant("float16").expr) == want
    assert not plans.plan_gemm_launch(512, 4096, 4096, 128, "float16", arch, 132, res, batch_invariant=True).tma
    with pytest.raises(ValueError, match="no tensor-map variant"):
        plans.plan_gemm_launch(40, 4096, 4096, 128, "float16", arch, 132, res, wgmma=True, tma=True)
