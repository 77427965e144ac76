"""Launch planning: which kernel path a matmul takes, and each kernel's launch plan, as frozen data.

Everything here is a pure function of numbers (the call's M, the weight's K, N and group size, the activation
dtype, the arch, the SM count) and of the per-process settings (``settings``) and dispatch table (``dispatch``):
no device is touched, so it is all checked on CPU. ``launch`` turns a plan into prepared kernel launches; ``ops``
validates the public calls and caches the prepared launches per weight and call shape.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import dispatch, settings
from .settings import GemvShapes

__all__ = ["Path", "GemvPlan", "GemmPlan", "choose_path", "plan_gemv", "plan_gemm", "plan_gemm_launch",
           "rounds_weights", "uses_cublas", "uses_pdl", "gemv_wide_takes", "cublas_beats_fused"]


class Path(enum.Enum):
    """The kernels a matmul runs: the swapped-operand GEMV, the fused GEMM, or dequantize + cuBLAS."""
    GEMV = "gemv"
    GEMM = "gemm"
    CUBLAS = "cublas"


@dataclass(frozen=True)
class GemvPlan:
    """Launch plan of the GEMV (kernels_cu/gemv_tc.cu): ``token_blocks`` of 8 rows, ``tiles`` 16-column blocks per
    warp unit, ``kdepth`` 64-k blocks per unit, ``aligned`` (groups of whole 64-k blocks), ``grid`` CTAs of
    ``warps`` warps with ``smem`` bytes of dynamic shared memory, over ``NT16`` 16-column blocks."""
    token_blocks: int
    tiles: int
    aligned: bool
    grid: int
    NT16: int
    warps: int
    smem: int
    kdepth: int = 1

    @property
    def scaled(self) -> bool:
        """Whether this variant multiplies by the rounded weights T((q - z) * s) (kernels.GemvVariant.scaled)."""
        return self.variant("float16").scaled

    def variant(self, dtype: str):
        """The kernel variant (kernels.GemvVariant) this plan launches for ``dtype`` activations."""
        from .kernels import GemvVariant

        return GemvVariant(dtype, self.token_blocks, self.tiles, self.aligned, self.kdepth)


@dataclass(frozen=True)
class TailSplit:
    """The fused GEMM's last ``ctas`` column tiles, launched apart with split-K (``GemmPlan.tail_grid``), in
    ``splits`` of ``per`` 64-k units each, summed by the reduce kernel over their columns only. The column tiles
    before them (``GemmPlan.grid``) run unsplit in whole waves."""
    ctas: int
    splits: int
    per: int


@dataclass(frozen=True)
class GemmPlan:
    """Launch plan of the fused GEMM: the ``wgmma`` kernel (kernels_cu/gemm_wg.cu) or the mma.sync one
    (gemm_tc.cu); its shape (``token_blocks`` of 8 rows, ``tiles`` 16-column blocks per warp, ``depth`` units in
    registers), ``aligned`` groups, ``grid`` (column CTAs, splits, token tiles), ``splits`` of ``per`` 64-k units,
    ``smem`` bytes, ``NT16`` 16-column blocks, ``ksplit`` K streams per CTA; ``pend`` the wgmma PEND variant when
    not the default (None), ``reduce_cols`` the split-K reduce kernel's columns per thread (0 without a split).
    With a ``tail``, ``grid`` is the first launch's (whole waves of unsplit column tiles, ``splits`` = 1) and the
    tail's column tiles after it are a second, split launch (``tail_grid``) whose reduce takes ``reduce_cols``.
    ``producers``: the wgmma kernel's x-producer variant, which copies x itself (no x tile pass before it);
    ``tma``: its tensor-map variant, which reads x as it is (no x tile pass either)."""
    wgmma: bool
    token_blocks: int
    tiles: int
    depth: int
    aligned: bool
    grid: tuple
    splits: int
    per: int
    smem: int
    NT16: int
    ksplit: int = 1
    pend: int | None = None
    reduce_cols: int = 0
    tail: TailSplit | None = None
    producers: bool = False
    tma: bool = False

    @property
    def tail_grid(self) -> tuple:
        """The tail launch's grid (column tiles, splits, token tiles); () without a tail."""
        return (self.tail.ctas, self.tail.splits, self.grid[2]) if self.tail is not None else ()

    @property
    def ctas(self) -> int:
        """CTAs of the GEMM launches, the tail's included."""
        return math.prod(self.grid) + (math.prod(self.tail_grid) if self.tail is not None else 0)

    @property
    def tail_block0(self) -> int:
        """The tail launch's first 16-column block (its ``blk_base``); 0 without a tail."""
        from .kernels import GEMM_WARPS

        return self.grid[0] * (GEMM_WARPS // self.ksplit) * self.tiles if self.tail is not None else 0

    def variant(self, dtype: str):
        """The kernel variant (kernels.WgmmaVariant or kernels.GemmVariant) this plan launches."""
        from .kernels import GemmVariant, WgmmaVariant

        if self.wgmma:
            return WgmmaVariant(dtype, self.token_blocks, self.tiles, self.depth, self.aligned, self.pend,
                                self.ksplit, self.producers, self.tma)
        return GemmVariant(dtype, self.token_blocks, self.tiles, self.depth, self.aligned)


@dataclass(frozen=True)
class RowSplit:
    """A matmul call run as two calls on row slices: the first ``rows`` rows (whole largest token tiles of the
    fused GEMM, ``first`` their plan) and the rest (``second``: its own plan, a GEMV or a GEMM of a smaller token
    tile), instead of one GEMM whose last token tile is mostly padding (``row_split``)."""
    rows: int
    first: GemmPlan
    second: GemmPlan | GemvPlan


def choose_path(M: int, K: int, N: int, group_size: int, dtype: str, arch, sm_count: int, *,
                batch_invariant: bool = False, capturing: bool = False) -> Path:
    """The kernels matmul runs for M rows of a K x N weight: the GEMV up to the dispatch row's ``gemv_max_m`` and
    where ``gemv_wide_takes`` gives it the layer; dequantize + cuBLAS (fp16) where ``cublas_beats_fused``, except
    while the stream captures a CUDA graph (CuPy cannot capture cuBLAS); else the fused GEMM. Batch-invariant calls
    always take the fused GEMM."""
    if batch_invariant:
        return Path.GEMM
    if M <= dispatch.for_arch(arch.key).gemv_max_m or gemv_wide_takes(M, K, N, group_size, arch, sm_count, dtype):
        return Path.GEMV
    if dtype == "float16" and not capturing and cublas_beats_fused(M, K, N, arch, sm_count):
        return Path.CUBLAS
    return Path.GEMM


def gemv_shape_args(w, plan: GemvPlan) -> tuple:
    """The GEMV's arguments after M for weight ``w`` (anything with K, N, KS, NT, NG and group_size): N, K, NT16,
    KS, G, NG, Np and the fast dividers (gemv_dividers); a variant compiled for one launch shape
    (kernels.gemv_shape_family) takes them as constants."""
    from .jit import as_i32

    return ((as_i32(w.N), as_i32(w.K), as_i32(plan.NT16), as_i32(w.KS), as_i32(w.group_size), as_i32(w.NG),
             as_i32(w.NT * 64))
            + gemv_dividers(plan.grid, plan.NT16, plan.warps, w.KS, w.group_size, plan.kdepth))


def plan_gemm_launch(M: int, K: int, N: int, group_size: int, dtype: str, arch, sm_count: int,
                     resident: Callable[[object, int], int], *, batch_invariant: bool = False,
                     tiles: int | None = None, splits: int | None = None, wgmma: bool | None = None,
                     depth: int | None = None, pend: int | None = None, reduce_cols: int | None = None,
                     ksplit: int | None = None, tail: bool | None = None,
                     token_tile: int | None = None, producers: bool | None = None,
                     tma: bool | None = None, pend_own_grid: bool | None = None,
                     tail_gain: float | None = None) -> GemmPlan:
    """The fused GEMM's whole launch plan for M rows, variant included: the wgmma kernel where ``uses_wgmma``
    (or ``wgmma``), its shape for M (``gemm_shape_for``), split-K planned over the CTAs the GPU holds at once
    (``resident(variant, smem)``: CTAs of that kernel one SM holds; batch-invariant calls plan for one
    per SM so that no variant's occupancy enters), two K streams where ``wgmma_ksplit`` says so, the two-CTAs-per-SM
    PEND variant where ``wgmma_pend`` does, and the reduce kernel's columns (``reduce_columns``). The other
    arguments force a choice (for tuning and probes); ``tail`` and ``token_tile`` as for ``plan_gemm``;
    ``producers``: the x-producer variant (None: wherever the planned shape and PEND have one, ``X_PRODUCERS``);
    ``tma``: the tensor-map variant (None: where ``x_by_tensor_map`` says so and no producers run);
    ``pend_own_grid``: whether the PEND 2 variant may be taken for its own grid (None: ``PEND_TWO_OWN_GRID``);
    ``tail_gain`` as for ``plan_gemm``."""
    from .kernels import GemmVariant, WgmmaVariant, has_producers, has_tma

    wg = uses_wgmma(arch, None if batch_invariant else M) if wgmma is None else wgmma
    nb, tw, depth = gemm_shape_for(M, tiles, wgmma=wg, depth=depth, token_tile=token_tile)
    aligned = aligned_groups(group_size, max(1, K // group_size))
    xp = wg and pend is None and has_producers((nb, tw, depth)) and (X_PRODUCERS if producers is None
                                                                      else bool(producers))
    if tma and (not wg or xp or not has_tma((nb, tw, depth))):
        raise ValueError(f"tma=True: the planned GEMM (wgmma={wg}, shape {(nb, tw, depth)}, producers={xp}) has "
                         f"no tensor-map variant")
    xt = wg and not xp and (x_by_tensor_map(M, N, (nb, tw, depth), batch_invariant) if tma is None else bool(tma))

    def planned(variant, ks) -> GemmPlan:
        res = sm_count if batch_invariant else resident(variant, variant.smem_bytes) * sm_count
        return plan_gemm(M, K, N, group_size, wgmma=wg, sm_count=sm_count, resident=res, tiles=tw, splits=splits,
                         batch_invariant=batch_invariant, depth=depth, ksplit=ks, tail=tail, token_tile=8 * nb,
                         tail_gain=tail_gain)

    chosen_pend = pend
    if wg:
        if ksplit is None and pend is not None:   # two-stream variants exist for the default PEND only
            ksplit = 1
        ks = 1 if ksplit is None else ksplit      # None: the plan chooses (wgmma_ksplit)
        p = planned(WgmmaVariant(dtype, nb, tw, depth, aligned, pend, ks, tma=xt), ksplit)
        two = (wgmma_pend((nb, tw, depth), None, sm_count, batch_invariant)
               if pend is None and p.ksplit == 1 else None)
        if two is not None:   # planned for two CTAs per SM; taken where the default's grid overfills one CTA per
            # SM, or (PEND_TWO_OWN_GRID) its own does with at least _PEND_TWO_MIN_UNITS units per split
            q = planned(WgmmaVariant(dtype, nb, tw, depth, aligned, two, tma=xt), 1)
            own = (PEND_TWO_OWN_GRID if pend_own_grid is None else pend_own_grid) and q.per >= _PEND_TWO_MIN_UNITS
            ctas = max(p.ctas, q.ctas) if own else p.ctas
            if wgmma_pend((nb, tw, depth), ctas, sm_count, batch_invariant) is not None:
                chosen_pend, p = two, q
    else:
        p = planned(GemmVariant(dtype, nb, tw, depth, aligned), 1)
    cols = 0
    if p.splits > 1 or p.tail is not None:   # a tail's reduce covers its own columns only
        cols = (reduce_columns(M, N - 16 * p.tail_block0, sm_count) if reduce_cols is None else reduce_cols)
    if xp and chosen_pend is not None:   # the two-per-SM PEND has no x-producer variant
        xp = False
    if producers and not xp:
        raise ValueError(f"producers=True: the planned wgmma GEMM (shape {(nb, tw, depth)}, PEND {chosen_pend}) "
                         f"has no x-producer variant")
    return dataclasses.replace(p, pend=chosen_pend if wg else None, reduce_cols=cols, producers=xp, tma=xt)


# Whether the 128-token tile's two-CTAs-per-SM PEND variant is also taken where only its own planned grid (more
# splits) has more CTAs than SMs, not just the default PEND's grid (wgmma_pend), when each of its splits keeps at
# least _PEND_TWO_MIN_UNITS 64-k units. H100 A/B at M = 96 and 128 against the default-PEND plans
# (docs/design.md §wgmma GEMM (gemm_wg)): faster with 28 to 112 units per split (Llama-2-70B down 111.1 -> 102.0
# us, o 36.5 -> 35.5, Mistral-7B down 32.7 -> 31.8 at M = 96), slower with 8 (Mistral-7B o at M = 96, 8 splits:
# 14.7 -> 16.8, where the fp32 partials and each CTA's start outweigh the second CTA per SM).
PEND_TWO_OWN_GRID = True
_PEND_TWO_MIN_UNITS = 16

# Whether the wgmma GEMM's 128- and 256-token tiles copy x inside the kernel (producer warps) instead of after an x
# tile pass: docs/design.md §wgmma GEMM (gemm_wg). Off until measured on the GPU.
X_PRODUCERS = False
# Whether the wgmma GEMM may read x through a tensor map (awq_gemm_wg_tma_kernel) instead of after an x tile pass,
# and up to which N (x_by_tensor_map).
X_TMA = True
X_TMA_MAX_N = 16384
# The fused GEMM's modelled unit time where it reads x through a tensor map, relative to the dispatch row's (fitted
# with the x tile pass): the mean ratio over the layers with N <= 16384 at M = 1024 and 4096 (H100 A/B, 0.91-0.98;
# docs/design.md §Dispatch).
_TMA_UNIT_SCALE = 0.95


def x_by_tensor_map(M: int, N: int, shape: tuple, batch_invariant: bool = False) -> bool:
    """Whether the wgmma GEMM of ``shape`` (token blocks, tiles, depth) reads x through a tensor map (no x tile
    pass; the weight words reordered in registers) for M rows of N output columns: where the shape has that
    variant, on 256-token tiles that M fills exactly, N up to ``X_TMA_MAX_N``, never for batch-invariant calls (docs/design.md §wgmma GEMM (gemm_wg), H100
    A/B). The pass costs M x K x 4 bytes of DRAM traffic once per call, which narrow layers (few column tiles per
    token tile) pay in full and wide ones spread over many tiles; reading x rows in place cost a few percent per
    tile on a wide layer (Llama-2-70B gate_up, N = 57344: 4.6% at M = 4096), while every layer with N <= 14336
    gained 2-9% from M = 256. A token tile that runs past M made the copy much slower (Mistral-7B qkv at M = 192:
    25.7 -> 40.6 us), and the 128-token tile at M = 128 was level (o gained, qkv and down lost 2-3%). The sums
    round in another k order than after the pass, so batch-invariant calls, whose rows must not depend on M, keep
    the pass."""
    from .kernels import has_tma

    return (X_TMA and not batch_invariant and has_tma(shape) and 8 * shape[0] == 256 and M % 256 == 0
            and N <= X_TMA_MAX_N)


# ----------------------------------------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------------------------------------
_MIN_STAGES_PER_SPLIT = 4    # each split gets at least 4 x 64 k (default of plan_splits)


# Split-K cost model (H200; docs/design.md §Split-K reduce): units per CTA x the kernel's unit time (``stage_us``) x
# the load of the busiest SM, plus each split's fp32 partials (8 bytes per output at _PARTIAL_TBPS) and _REDUCE_US for
# the reduce kernel. The GEMM planners pass their kernel's unit time (_unit_us); _STAGE_US, the default, is that of a
# latency-bound unit, the same whatever the m-block count. CTAs sharing an SM each run slower: k co-resident CTAs take
# 1 + share x (k - 1) times as long as one alone. Counting them as independent slots instead picks too many splits
# (Mistral-7B o at M = 128 with two CTAs per SM: 5 splits, 160 CTAs on 132 SMs, where 4 splits, 128 CTAs, run
# faster). _SHARE is fitted to sweeps of the mma.sync GEMM; the wgmma GEMM's constants (_WG_UNIT_US, _WG_SHARE) and
# the partials / reduce terms to sweeps of o, qkv and down at M = 32..128 with 2..16 splits: over those 15 cases the
# planned splits run ~1 us slower in all than the best measured ones.
_STAGE_US, _PARTIAL_TBPS, _REDUCE_US, _SHARE = 1.75, 4.0, 4.0, 0.3


# wgmma: a unit's floor, the 256-token tile's unit with one block per warp (as the dispatch row's fused_unit_us),
# the co-residence share
_WG_UNIT_US, _WG_UNIT_US_256, _WG_SHARE = 0.5, 0.78, 0.1
# Two CTAs per SM (the 128-token tile's PEND 2 variant) on a grid of more than one wave keep the SM busy: a pair
# shares the tensor cores (``tensor_us``), and a CTA alone on its SM in the last round runs a unit in _PAIR_LONE
# of a pair's time. Fitted to Llama-2-70B gate_up at M = 128 (448 column tiles on 264 slots) with its last 184
# tiles split 2, 3, 4, 5 and 7 ways in a tail launch (H200, fp16 and bf16; docs/design.md §Split-K reduce): with
# it the model ranks the five splits as measured, each within 3% of its measured time. PAIR_TAILS: whether the
# planners use these terms; with them they plan that grid's two-way tail (3-4% faster on that layer, its GPU tests
# and memcheck in bench/device/run.sh pair_tail_check). Off, the planners price pairs as before (an A/B switch).
_PAIR_LONE = 0.55
PAIR_TAILS = True


def _wg_tensor_us(token_blocks: int, tiles: int) -> float:
    """The wgmma GEMM's tensor work per 64-k unit of one CTA: 0.78 us for the 256-token tile with one block per
    warp, in proportion to tokens x blocks per warp."""
    return _WG_UNIT_US_256 * token_blocks * tiles / 32


def pair_sm_terms(token_blocks: int, tiles: int, ksplit: int, per_sm: int) -> dict:
    """``split_cost``'s ``tensor_us`` and ``lone`` for the wgmma GEMM of that shape at ``per_sm`` CTAs per SM where
    ``PAIR_TAILS`` is on: the tensor cores' share of a unit, and a lone CTA's unit as ``_PAIR_LONE`` of a full
    SM's; {} for one CTA per SM or with the switch off."""
    if not PAIR_TAILS or per_sm < 2:
        return {}
    return dict(tensor_us=_wg_tensor_us(token_blocks, tiles) / ksplit, lone=_PAIR_LONE)


def plan_splits(K_stages: int, n_ctas: int, m_tiles: int, *, resident: int, M: int = 1, Np: int = 64,
                stage_us: float = _STAGE_US, min_per: int = _MIN_STAGES_PER_SPLIT, per_sm: int = 1,
                share: float = _SHARE) -> tuple[int, int]:
    """(splits, stages_per_split) for a grid of n_ctas x m_tiles CTAs over K_stages 64-k stages, when the GPU
    holds ``resident`` CTAs at once, ``per_sm`` on each SM: the split count with the least modelled time (stages
    per CTA x stage time x the busiest SM's load, plus the partial sums' traffic and the reduce kernel when
    split); at least ``min_per`` stages per split; ``share``: the slowdown per co-resident CTA."""
    return split_cost(K_stages, n_ctas, m_tiles, resident=resident, M=M, Np=Np, stage_us=stage_us, min_per=min_per,
                      per_sm=per_sm, share=share)[1:]


@functools.lru_cache(maxsize=4096)
def split_cost(K_stages: int, n_ctas: int, m_tiles: int, *, resident: int, M: int = 1, Np: int = 64,
               stage_us: float = _STAGE_US, min_per: int = _MIN_STAGES_PER_SPLIT,
               per_sm: int = 1, share: float = _SHARE, tensor_us: float = 0.0,
               lone: float = 0.0) -> tuple[float, int, int]:
    """(modelled us, splits, stages per split) of ``plan_splits``' choice. ``tensor_us``: the unit's tensor-core
    time, which k CTAs sharing an SM cannot overlap (a unit then takes at least k x ``tensor_us``); 0 leaves it out,
    as the split planners do. ``lone``: where ``per_sm`` > 1, a unit's time for a CTA alone on its SM (the grid's
    last round after whole waves, or a grid of at most one CTA per SM) as a fraction of a unit's on a full SM
    (``pair_sm_terms``); 0: the co-residence model's. Memoised: the search over split counts costs tens of
    microseconds of host time, and ``matmul`` asks for the same shapes call after call."""
    base = n_ctas * m_tiles
    per_sm = max(1, per_sm)
    sms = max(1, resident // per_sm)
    full_sm = max(stage_us * (1 + share * (per_sm - 1)), tensor_us * per_sm)   # a unit's time, per_sm CTAs sharing
    lone_us = lone * full_sm if per_sm > 1 else 0.0
    best = None
    for splits in range(1, max(1, K_stages // min_per) + 1):
        per = -(-K_stages // splits)
        real = -(-K_stages // per)              # splits that actually get stages
        ctas = base * real
        k = -(-ctas // sms)                     # CTAs the busiest SM runs over the whole grid
        if k <= per_sm:                         # all resident at once, k of them sharing that SM
            t = per * (lone_us if k == 1 and lone_us else max(stage_us * (1 + share * (k - 1)), tensor_us * k))
        else:                                   # waves of full SMs
            waves, last = divmod(ctas, resident)
            if lone_us and 0 < last <= sms:     # a last round of one CTA per SM
                t = per * (waves * full_sm + lone_us)
            else:
                t = -(-ctas // resident) * per * full_sm
        if real > 1:
            t += real * M * Np * 8 / (_PARTIAL_TBPS * 1e6) + _REDUCE_US
        if best is None or t < best[0] - 1e-9:
            best = (t, real, per)
    return best



def rounds_weights(M: int, batch_invariant: bool = False, arch_key: str = "90", *, K: int | None = None,
                   N: int | None = None, group_size: int | None = None, dtype: str = "float16",
                   sm_count: int = 132) -> bool:
    """Whether matmul at this M multiplies x by the weights rounded to x's dtype, T((q - z) * s) (like
    ``dequantize``), or by the exact (q - z) * s with the scale applied to fp32 group sums (the GEMV). At GEMV
    sizes that depends on the launch plan (kernels.GemvVariant.scaled: the pairs at two token blocks round), and beyond
    the table's ``gemv_max_m`` on whether ``gemv_wide_takes`` gives the layer to the GEMV (exact) or the GEMM, so
    give the weight's K, N, group size, the activations' dtype and the GPU's SM count; without K and N the answer
    is the other GEMV variants' (exact) up to ``gemv_max_m`` and the GEMM's beyond it."""
    from .jit import ARCHS

    if batch_invariant:
        return True
    if M > dispatch.for_arch(arch_key).gemv_max_m:
        if K is None or N is None or arch_key not in ARCHS:
            return True
        return not gemv_wide_takes(M, K, N, K if group_size is None else group_size, ARCHS[arch_key], sm_count,
                                   dtype)
    if K is None or N is None:
        return False
    p = plan_gemv(M, K, N, K if group_size is None else group_size, arch=ARCHS[arch_key], sm_count=sm_count,
                  dtype=dtype)
    return p.scaled


def uses_cublas(M: int, dtype: str, arch_key: str = "90", batch_invariant: bool = False, *, K: int | None = None,
                N: int | None = None, sm_count: int = 132) -> bool:
    """Whether matmul at this M (outside graph capture) takes the dequantize + cuBLAS path: for a K x N weight
    when both are given, else whether it may for some shape (M at least the table's ``cublas_min_m``)."""
    from .jit import ARCHS

    if batch_invariant or dtype != "float16":
        return False
    if K is None or N is None or arch_key not in ARCHS:
        return M >= dispatch.for_arch(arch_key).cublas_min_m
    return cublas_beats_fused(M, K, N, ARCHS[arch_key], sm_count)


def cublas_beats_fused(M: int, K: int, N: int, arch, sm_count: int = 132) -> bool:
    """Dequantize + cuBLAS rather than the fused GEMM for M rows of a K x N weight on ``arch``: from the dispatch
    row's ``cublas_min_m`` on, for every shape, or, where the row has a cost model (and the fused GEMM is the
    wgmma one), where the model says so. The fused GEMM's modelled time is ``split_cost`` of its 256-token tile
    with the row's unit time and one CTA per SM (the shape M >= 256 runs), or ``tail_split_cost`` where
    ``plan_gemm`` would plan a tail launch, or two K streams' where it would plan those; where M overruns whole
    256-token tiles,
    the cheaper of that and the row split's two calls (the whole tiles, then the rest on its own token tile, at the
    row's unit time scaled as ``_unit_us`` scales it), as ``row_split`` may run them. Dequantize + cuBLAS costs
    K x N x 2.5 bytes (int4 in, fp16 out) at ``dequant_tbps`` plus 2 M K N flops at ``cublas_tflops``."""
    from .kernels import GEMM_WARPS
    from .layout import padded_sizes

    row = dispatch.for_arch(arch.key)
    if M < row.cublas_min_m:
        return False
    if not row.has_cost_model or not uses_wgmma(arch, M):
        return True
    Kp, Np = padded_sizes(K, N)

    def fused(m: int) -> float:   # the one-launch plan, or whole waves and a split tail where that is planned
        nb, tw, depth = gemm_shape_for(m, wgmma=True)
        unit = row.fused_unit_us * _unit_us(nb, tw, True) / _unit_us(32, 1, True)
        if x_by_tensor_map(m, N, (nb, tw, depth)):   # no x tile pass
            unit *= _TMA_UNIT_SCALE
        kw = dict(resident=sm_count, M=m, Np=Np, stage_us=unit, min_per=2, per_sm=1, share=_WG_SHARE)
        grid = (Kp // 64, -(-(Np // 16) // (GEMM_WARPS * tw)), -(-m // (8 * nb)))
        t, splits, _ = split_cost(*grid, **kw)
        if nb >= _TAIL_MIN_NB:
            t_tail = tail_split_cost(*grid, cols_per_tile=16 * GEMM_WARPS * tw, **kw)[0]
            if t_tail < _TAIL_GAIN * t:
                t, splits = t_tail, 1
        if two_streams_considered(m, N, (nb, tw, depth)):   # two K streams, as plan_gemm weighs them
            kw2 = dict(kw, stage_us=unit / 2, min_per=4)
            grid2 = (grid[0], 2 * grid[1], grid[2])   # (K units, column tiles of 64 channels, token tiles)
            t_two, _, per = split_cost(*grid2, **kw2)
            if _KSPLIT_TMA_TAILS and splits > 1:   # ending in a split tail, in place of a split plan only
                t_tail = tail_split_cost(*grid2, cols_per_tile=16 * GEMM_WARPS // 2 * tw, **kw2)[0]
                if t_tail < _TAIL_GAIN * t_two:
                    t_two, per = t_tail, grid[0]
            if two_streams_win(splits, per, t, t_two):
                t = t_two
        return t

    rest = M % 256
    t = fused(M) if not rest else min(fused(M), fused(M - rest) + fused(rest))
    dense = K * N * 2.5 / (row.dequant_tbps * 1e6) + 2.0 * M * K * N / (row.cublas_tflops * 1e6)
    return dense < t


def gemv_tiles_for(M: int, NT16: int, grid: int, dtype: str = "float16", slot: dict | None = None) -> int:
    """16-column blocks per GEMV warp unit: the variant whose padded blocks per CTA (a CTA takes its blocks TW at a
    time), each at its relative slot time, cost least; the larger unit on a tie; single blocks when a CTA has only
    one. ``slot`` ({tiles: time}) defaults to the H200's for ``dtype`` and M's token blocks
    (``dispatch.H200_GEMV_SLOT``; ``plan_gemv`` passes the dispatch row's). On the H200
    (docs/design.md §GEMV (gemv_tc)): up to 8 tokens pairs at 2 and 5 blocks per CTA, threes at 3, fours at 4, 14
    and 28; at 9..16 tokens pairs at 2, threes at 3, 5 and 14, fours at 4 and 28 (bf16: pairs at 2 and 5, fours
    otherwise). Padding counts: at 3 blocks per CTA the threes beat the fours (one padded slot) by 7-10% at M = 1
    and 16 (Mistral-7B qkv, fp16)."""
    most = -(-NT16 // grid)
    if most < 2:
        return 1
    return gemv_tiles_by_slot(most, slot if slot is not None else dispatch.default_gemv_slot(dtype, -(-M // 8)))


def gemv_tiles_by_slot(most: int, slot: dict[int, float]) -> int:
    """``gemv_tiles_for``'s rule for a CTA of ``most`` blocks: the tiles whose padded slots cost least at ``slot``'s
    times, the larger on a tie."""
    return min(slot, key=lambda tw: (-(-most // tw) * tw * slot[tw], -tw))


def gemv_kdepth_for(NT16: int, grid: int, tiles: int, slot: dict[int, float], kd2: float | None,
                    aligned: bool = True) -> int:
    """64-k blocks per GEMV unit: 2 (the pair variant with two blocks per unit) where its padded block slots at
    time ``kd2`` (the dispatch row's ``gemv_kd2_for``) cost less than those of ``tiles`` (``gemv_tiles_for``'s
    choice) at ``slot``'s, for groups of whole 64-k blocks; else 1 (also when ``kd2`` is None)."""
    if kd2 is None or not aligned:
        return 1
    return gemv_kdepth_by_slot(-(-NT16 // grid), tiles, slot, kd2)


def gemv_kdepth_by_slot(most: int, tiles: int, slot: dict[int, float], kd2: float) -> int:
    """``gemv_kdepth_for``'s rule for a CTA of ``most`` blocks whose tiles rule chose ``tiles``: 2 where the pairs'
    padded slots at ``kd2`` cost less than the chosen tiles' at ``slot``'s times, else 1."""
    if tiles < 2 or tiles not in slot:
        return 1
    return 2 if -(-most // 2) * 2 * kd2 < -(-most // tiles) * tiles * slot[tiles] else 1


def aligned_groups(group_size: int, NG: int) -> bool:
    """Whether the scale groups are whole 64-k blocks (or there is one group): the kernels' GA variants."""
    return group_size % 64 == 0 or NG == 1


def gemv_grid(N: int, sm_count: int) -> tuple[int, int]:
    """(16-column blocks, CTAs) of the GEMV for N output channels: one CTA per SM, at most one per block."""
    from .layout import padded_sizes

    NT16 = padded_sizes(64, N)[1] // 16
    return NT16, max(1, min(NT16, sm_count))


def plan_gemv(M: int, K: int, N: int, group_size: int, *, arch=None, sm_count: int = 132,
              tiles: int | None = None, warps: int | None = None, dtype: str = "float16",
              kdepth: int | None = None) -> GemvPlan:
    """Launch plan of the GEMV for M <= 32 tokens on ``arch`` (a jit.Arch; default sm_90). One CTA per SM (at most one
    per 16-column block) of the variant's warp count. ``tiles`` (blocks per warp unit) and ``kdepth`` (64-k blocks
    per unit) default to ``gemv_tiles_for`` (with the dispatch row's slot times for the activations' ``dtype``) and
    ``gemv_kdepth_for``; given ``tiles``, ``kdepth`` defaults to 1, and ``kdepth`` 2 alone means pairs. ``warps``
    overrides the warp count (for tuning). The plan depends on (M, K, N, G), the dtype and the GPU, and so does the
    summation order. Three and four token blocks (17..32 rows) exist on compute capability 9.0 for groups of whole
    64-k blocks (kernels.gemv_shapes); matmul runs them where ``gemv_wide_takes`` says so."""
    from .jit import ARCHS
    from .kernels import GEMV_KD2_SHAPES, GEMV_TOKEN_BLOCKS, GemvVariant, gemv_shapes

    arch = ARCHS["90"] if arch is None else arch
    nb = -(-M // 8)
    if M < 1 or nb not in GEMV_TOKEN_BLOCKS:
        raise ValueError(f"no GEMV variant for M={M} (1 to {8 * max(GEMV_TOKEN_BLOCKS)} rows)")
    NT16, grid = gemv_grid(N, sm_count)
    aligned = aligned_groups(group_size, max(1, K // group_size))
    shapes = gemv_shapes(arch, aligned)
    if not any(s[0] == nb for s in shapes):
        raise ValueError(f"no GEMV variant for M={M} on {arch.target} with group size {group_size}: more than "
                         f"16 rows need an arch with the wide GEMV (sm_90) and groups of whole 64-k blocks")
    if tiles is None and kdepth == 2:
        tw = 2                                   # the two-k-block variants are pairs
    elif tiles is None:
        row = dispatch.for_arch(arch.key)
        slot = _gemv_slot_for(row, dtype, nb, shapes)
        tw = gemv_tiles_for(M, NT16, grid, slot=slot)
        if (nb, tw) not in shapes:   # single blocks at three token blocks: the pairs, their second block missing
            tw = min(t for n, t in shapes if n == nb and t > tw)
        if kdepth is None:
            kd2 = row.gemv_kd2_for(dtype, nb) if (nb, 2) in GEMV_KD2_SHAPES else None
            kdepth = gemv_kdepth_for(NT16, grid, tw, slot, kd2, aligned)
            tw = 2 if kdepth == 2 else tw
    else:
        tw = tiles
    if (nb, tw) not in shapes:
        raise ValueError(f"tiles={tw} is not a GEMV variant for M={M}; instantiated (token blocks, tiles) on "
                         f"{arch.target}{'' if aligned else ' for groups that split a 64-k block'}: {shapes}")
    kd = 1 if kdepth is None else kdepth
    if kd != 1 and (kd != 2 or (nb, tw) not in GEMV_KD2_SHAPES or not aligned):
        raise ValueError(f"kdepth={kdepth}: 1, or 2 for (token blocks, tiles) in {GEMV_KD2_SHAPES} with groups of "
                         f"whole 64-k blocks (G={group_size})")
    variant = GemvVariant(dtype, nb, tw, aligned, kd)
    most = variant.max_warps(arch)
    w = most if warps is None else warps
    if not 1 <= w <= most:
        raise ValueError(f"warps={warps}: the GEMV variant for M={M}, tiles={tw}, G={group_size} runs 1 to {most} "
                         f"warps per CTA")
    return GemvPlan(token_blocks=nb, tiles=tw, aligned=aligned, grid=grid, NT16=NT16, warps=w,
                    smem=variant.smem_bytes(w), kdepth=kd)


def _gemv_slot_for(row, dtype: str, nb: int, shapes) -> dict[int, float]:
    """The dispatch row's GEMV slot times for ``nb`` token blocks, less the tiles not instantiated there."""
    slot = {tw: t for tw, t in row.gemv_slot_for(dtype, nb).items() if (nb, tw) in shapes}
    return slot or {max(tw for n, tw in shapes if n == nb): 1.0}


# Beyond 16 rows (three and four token blocks) matmul runs the GEMV on weights of at most GEMV_WIDE_SMALL elements
# up to the dispatch row's gemv_wide_max_m, and on larger ones up to GEMV_WIDE_THREES_MAX_M rows where the GEMV's
# plan has three or four blocks per unit (gemv_wide_takes).
GEMV_WIDE_SMALL = 1 << 25


GEMV_WIDE_THREES_MAX_M = 24


def gemv_wide_takes(M: int, K: int, N: int, group_size: int, arch, sm_count: int = 132,
                    dtype: str = "float16") -> bool:
    """Whether matmul runs the GEMV's three- or four-token-block variant for M rows of a K x N weight on ``arch``
    instead of the GEMM: for 16 < M <= the dispatch row's ``gemv_wide_max_m`` (and above its ``gemv_max_m``), on
    compute capability 9.0 with groups of whole 64-k blocks and more 16-column blocks than CTAs (the measured
    layers have 2 to 28 per CTA), where K x N <= GEMV_WIDE_SMALL, or M <= 24 and the GEMV's plan takes three or
    four blocks per unit.

    Measured on the H200 (docs/design.md §Crossovers), this picks the faster of the two on all 56 layer rows of
    Mistral-7B at M = 17..32 (fp16; 17, 24 and 32 bf16) and Llama-2-70B at M = 17, 24, 32 (fp16 and bf16; one a
    tie). The GEMV's fixed cost is lower, the GEMM's cost per weight: the GEMV wins on the small layers at every M
    (Mistral-7B qkv at M = 32 by ~20%), on the large ones up to 24 rows where its units have three or four blocks
    (Llama-2-70B gate_up at M = 24 by ~20%), and loses where the units are pairs (Mistral-7B down: two blocks per
    CTA, ~9% at M = 24) or at 25..32 rows (Mistral-7B gate_up at M = 32, ~3%)."""
    row = dispatch.for_arch(arch.key)
    if not max(row.gemv_max_m, dispatch.GEMV_LIMIT) < M <= row.gemv_wide_max_m or not arch.gemv_wide:
        return False
    NT16, grid = gemv_grid(N, sm_count)
    if not aligned_groups(group_size, max(1, K // group_size)) or NT16 <= grid:
        return False   # (one block per CTA: not measured; the GEMM)
    if K * N <= GEMV_WIDE_SMALL:
        return True
    if M > GEMV_WIDE_THREES_MAX_M:
        return False
    from .kernels import gemv_shapes

    return gemv_tiles_for(M, NT16, grid, slot=_gemv_slot_for(row, dtype, -(-M // 8), gemv_shapes(arch))) >= 3


def uses_pdl(arch) -> bool:
    """Whether awq_cupy's GEMV / GEMM kernels launch with programmatic dependent launch on ``arch`` (compute
    capability 9.0+, unless AWQ_CUPY_PDL=0): a kernel may then start while the previous kernel of the stream
    finishes (when that kernel allows it: only awq_cupy's own do) and request its first weights meanwhile; it
    reads x and workspaces and writes only once the previous kernel has completed (kernels_cu/common.cuh). The
    weights must therefore not be written by the awq_cupy kernel launched just before."""
    return arch.pdl and settings.current().pdl


def fastdiv(d: int) -> np.uint64:
    """Kernel parameter for dividing by ``d`` (1 <= d < 2^31) in common.cuh ``fastdiv``: m | s << 32 with
    s = 31 + ceil(log2 d) and m = ceil(2^s / d), so that floor(n / d) = (n * m) >> s for every 0 <= n < 2^31
    (Granlund and Montgomery: m * d - 2^s < d <= 2^(s - 31))."""
    d = int(d)
    if not 1 <= d < 2**31:
        raise ValueError(f"fastdiv: divisor {d} must be 1 to 2^31 - 1")
    s = 31 + (d - 1).bit_length()
    m = -(-(1 << s) // d)
    assert m < 2**32
    return np.uint64(m | s << 32)


# Weights of at least this many elements (K x N) get a GEMV compiled for their launch shape (gemv_specializes).
GEMV_SHAPE_MIN_WEIGHTS = 1 << 22


def gemv_specializes(arch, K: int, N: int) -> bool:
    """Whether matmul's GEMV for a K x N weight on ``arch`` runs a variant compiled for its launch shape
    (kernels.gemv_shape_family: constant index arithmetic, no parameter loads in the loop; outputs bitwise the
    same as the generic kernel's). Where the arch has ``gemv_shapes`` (measured on 9.0: ~3% off the Mistral-7B
    layers at M = 1; docs/design.md §GEMV (gemv_tc)) for weights of at least GEMV_SHAPE_MIN_WEIGHTS elements, so
    that the one compile per shape (~0.3-0.5 s, then the disk cache) goes to model-sized layers.
    AWQ_CUPY_GEMV_SHAPES=0 never, =1 at any size (where the arch has ``gemv_shapes``)."""
    mode = settings.current().gemv_shapes
    if not arch.gemv_shapes or mode is GemvShapes.NEVER:
        return False
    return mode is GemvShapes.ALWAYS or K * N >= GEMV_SHAPE_MIN_WEIGHTS


# The token counts a shape-compiled GEMV is compiled for as well (AWQ_GEMV_M; H200, outputs the same bits;
# docs/design.md §GEMV (gemv_tc)). M = 16: faster on every benchmark layer (~1%, fp16 and bf16). M = 1: a fixed cost
# per call of the order of a tenth of a microsecond against ~1% off the loop, so only for weights of at least
# GEMV_M1_MIN_WEIGHTS elements (Mistral-7B gate_up and Llama-2-70B's layers gain; below it Mistral-7B qkv, o and down
# lose). Not M = 8 (no gain).
GEMV_M1_MIN_WEIGHTS = 1 << 26


def gemv_compiled_tokens(M: int | None, K: int, N: int) -> int | None:
    """The token count a shape-compiled GEMV for M rows of a K x N weight is compiled for too, or None."""
    return M if M == 16 or (M == 1 and K * N >= GEMV_M1_MIN_WEIGHTS) else None


@functools.lru_cache(maxsize=1024)
def gemv_dividers(grid: int, NT16: int, warps: int, KS: int, group_size: int, kdepth: int = 1) -> tuple:
    """The GEMV's fastdiv parameters (by its grid, warps per CTA, units per column group = ceil(64-k blocks /
    kdepth) and group size), cached per launch shape; the numerators (CTA index x 16-column blocks, 64 x the k
    blocks) must stay below 2^31."""
    if (grid + 1) * NT16 >= 2**31 or 64 * KS >= 2**31:
        raise ValueError(f"GEMV: {NT16} column blocks x {grid} CTAs or K = {64 * KS} too large "
                         f"for 32-bit index arithmetic")
    return (fastdiv(grid), fastdiv(warps), fastdiv(-(-KS // kdepth)), fastdiv(group_size))


# ----------------------------------------------------------------------------------------------------------------
# The fused GEMM: register-fed weights, x through shared memory; wgmma (kernels_cu/gemm_wg.cu) or mma.sync
# (kernels_cu/gemm_tc.cu awq_gemm_sw_kernel); docs/design.md §Kernel families
# ----------------------------------------------------------------------------------------------------------------
def _unit_us(token_blocks: int, tiles: int, wgmma: bool) -> float:
    """Modelled time of one 64-k unit of one GEMM CTA on the H200 (running alone on its SM).
    wgmma (fitted to split-K sweeps, see the split-K cost model): the larger of a ~0.5 us floor (the unit's barrier,
    x copy and first weight latency) and its tensor work, 0.78 us for the 256-token tile with one block per warp
    (dispatch row fused_unit_us), in proportion to tokens x blocks per warp. mma.sync: the larger of its weight
    stream (8 warps x tiles x 512 B at ~27 GB/s per SM) and its tensor work (2 x 128 tiles channels x 8 token blocks
    tokens x 64 k at the measured ~2.5 TFLOP/s per SM), plus a fixed ~0.1 us (barrier, first latency)."""
    if wgmma:
        return max(_WG_UNIT_US, _wg_tensor_us(token_blocks, tiles))
    mem = 8 * tiles * 512 / 27e3
    flops = 2 * 128 * tiles * 8 * token_blocks * 64
    return max(mem, flops / 2.5e6) + 0.1


def has_wgmma(arch) -> bool:
    """Whether ``arch`` has the warpgroup-MMA GEMM (kernels_cu/gemm_wg.cu, built for sm_90a): compute capability
    9.0, unless AWQ_CUPY_WGMMA=0."""
    return arch.wgmma and settings.current().wgmma


def uses_wgmma(arch, M: int | None = None) -> bool:
    """Whether the fused GEMM for M rows is the wgmma kernel on ``arch``: it has one and M >= the dispatch table's
    ``wgmma_min_m`` (``M=None``: for any M, as batch-invariant matmul runs one kernel for all)."""
    if not has_wgmma(arch):
        return False
    first = dispatch.for_arch(arch.key).wgmma_min_m
    return first is not None and (M is None or M >= first)


def _gemm_table(wgmma: bool):
    from .kernels import GEMM_DEFAULT, GEMM_SHAPES, GEMM_WG_DEFAULT, GEMM_WG_SHAPES

    return (GEMM_WG_SHAPES, GEMM_WG_DEFAULT) if wgmma else (GEMM_SHAPES, GEMM_DEFAULT)


def gemm_token_tile(M: int, wgmma: bool = False) -> int:
    """Rows per CTA of the GEMM for M rows: the smallest token tile that holds M (the largest when none does; M
    then takes several token tiles)."""
    tiles = sorted(_gemm_table(wgmma)[1])
    return next((t for t in tiles if t >= M), tiles[-1])


def gemm_shape_for(M: int, tiles: int | None = None, *, wgmma: bool = False,
                   depth: int | None = None, token_tile: int | None = None) -> tuple[int, int, int]:
    """(token blocks of 8, 16-column blocks per warp, units in registers) of the GEMM for M rows: the default shape
    of M's token tile (``gemm_token_tile``, or ``token_tile`` rows), or the instantiated one with ``tiles`` column
    blocks per warp (and ``depth`` units)."""
    shapes, default = _gemm_table(wgmma)
    if token_tile is not None and token_tile not in default:
        raise ValueError(f"token_tile={token_tile}: the {'wgmma' if wgmma else 'mma.sync'} GEMM's token tiles are "
                         f"{sorted(default)} rows")
    tile = gemm_token_tile(M, wgmma) if token_tile is None else token_tile
    for s in (default[tile],) + shapes:
        if 8 * s[0] == tile and tiles in (None, s[1]) and depth in (None, s[2]):
            return s
    what = f"tiles={tiles}" + (f", depth={depth}" if depth is not None else "")
    raise ValueError(f"{what} is not a GEMM variant for M={M} (token tile {tile}); instantiated "
                     f"(token blocks, tiles, depth): {shapes}")


def plan_gemm(M: int, K: int, N: int, group_size: int, *, wgmma: bool = False, sm_count: int = 132,
              resident: int | None = None, tiles: int | None = None, splits: int | None = None,
              batch_invariant: bool = False, depth: int | None = None, ksplit: int | None = None,
              tail: bool | None = None, token_tile: int | None = None,
              tail_gain: float | None = None) -> GemmPlan:
    """Launch plan of the GEMM (wgmma: the sm_90a kernel, else the mma.sync one), with the default PEND variant.
    ``resident`` = CTAs the GPU holds at once (default one per
    SM). Split-K from ``plan_splits`` with the unit-time model unless ``splits`` is given. ``batch_invariant``: the
    split count is planned for one 16-row token tile whatever M is, so a row's result does not depend on M.
    ``ksplit``: K streams per CTA of the wgmma GEMM (1 or 2); None chooses by ``wgmma_ksplit`` and, where x goes
    through the tensor map, by the model (``_KSPLIT_TMA``). ``tail``: a
    split tail launch (``TailSplit``) where ``tail_split_cost`` models it faster (None), never (False) or always
    where the grid has one (True, for tests and A/B runs); only for the wgmma GEMM with planned splits, with two K
    streams only where forced or with ``_KSPLIT_TMA_TAILS`` (chosen by ksplit=None only in place of a one-stream
    plan that splits K).
    ``token_tile``: rows per CTA (a token tile of the kernel's table) instead of ``gemm_token_tile``'s.
    ``tail_gain``: the fraction of the one-launch plan's modelled time a tail must model under to be planned
    (None: ``_TAIL_GAIN``)."""
    from .kernels import GEMM_WARPS, GemmVariant, WgmmaVariant
    from .layout import padded_sizes

    if M < 1:
        raise ValueError(f"M={M}: the GEMM needs at least one row")
    if tail_gain is not None and not 0.0 < tail_gain <= 1.0:
        raise ValueError(f"tail_gain={tail_gain}: a fraction of the one-launch plan's time, in (0, 1]")
    nb, tw, depth = gemm_shape_for(M, tiles, wgmma=wgmma, depth=depth, token_tile=token_tile)
    token_tile = 8 * nb
    tail = None if tail is None else bool(tail)   # (A/B runs pass 0 or 1)
    if ksplit is None:
        one = plan_gemm(M, K, N, group_size, wgmma=wgmma, sm_count=sm_count, resident=resident, tiles=tiles,
                        splits=splits, batch_invariant=batch_invariant, depth=depth, ksplit=1, tail=False,
                        token_tile=token_tile)
        ks = wgmma_ksplit(one, wgmma, batch_invariant, splits is not None)
        best = one if ks == 1 else None
        if tail is not False:
            t = plan_gemm(M, K, N, group_size, wgmma=wgmma, sm_count=sm_count, resident=resident, tiles=tiles,
                          splits=splits, batch_invariant=batch_invariant, depth=depth, ksplit=1, tail=tail,
                          token_tile=token_tile, tail_gain=tail_gain)
            # a split tail after whole waves beats two K streams where the model plans one: Mistral-7B qkv at
            # M = 768, 70.3 against 85.5 us (docs/design.md §Split-K reduce)
            if ks == 1 or t.tail is not None:
                best = t
        if best is not None:   # two K streams where x goes through the tensor map and the model says so
            if wgmma and splits is None and two_streams_considered(M, N, (nb, tw, depth), batch_invariant):
                # a two-stream tail only in place of a split plan (_KSPLIT_TMA_TAILS)
                two = plan_gemm(M, K, N, group_size, wgmma=True, sm_count=sm_count, resident=resident,
                                tiles=tiles, depth=depth, ksplit=2,
                                tail=None if tail is None and best.splits > 1 else False, token_tile=token_tile,
                                tail_gain=tail_gain)
                per_sm = max(1, (sm_count if resident is None else resident) // sm_count)

                def cost(p: GemmPlan) -> float:
                    return gemm_modelled_us(p, M, K, N, "float16", sm_count, lambda v, smem: per_sm)

                if two_streams_win(best.splits, two.per, cost(best), cost(two)):
                    return two
            return best
        ksplit, splits = 2, one.splits // 2
    if ksplit not in (1, 2) or (ksplit == 2 and not wgmma):
        raise ValueError(f"ksplit={ksplit}: 1, or 2 (two K streams per CTA) for the wgmma GEMM")
    Kp, Np = padded_sizes(K, N)
    NT16, KS = Np // 16, Kp // 64
    n_ctas = -(-NT16 // (GEMM_WARPS // ksplit * tw))   # ksplit = 2: each warpgroup covers all the CTA's channels
    m_tiles = -(-M // (8 * nb))
    res = sm_count if resident is None else resident
    share = _WG_SHARE if wgmma else _SHARE
    splits_forced = splits is not None
    if splits is not None:
        if not 1 <= splits <= KS:
            raise ValueError(f"splits={splits} must be 1 to {KS} (the 64-k units of K={K})")
        per = -(-KS // splits)
        splits = -(-KS // per)
    elif batch_invariant:   # planned as for the smallest token tile, whatever M and this M's shape are
        nb1, tw1, _ = gemm_shape_for(1, wgmma=wgmma)
        splits, per = plan_splits(KS, -(-NT16 // (GEMM_WARPS * tw1)), 1, resident=res, M=8 * nb1, Np=Np,
                                  stage_us=_unit_us(nb1, tw1, wgmma), min_per=2, per_sm=res // sm_count,
                                  share=share)
    else:   # two K streams run a CTA's units two at a time
        splits, per = plan_splits(KS, n_ctas, m_tiles, resident=res, M=M, Np=Np,
                                  stage_us=_unit_us(nb, tw, wgmma) / ksplit, min_per=2 * ksplit,
                                  per_sm=res // sm_count, share=share)
    NG = max(1, K // group_size)
    smem = (WgmmaVariant if wgmma else GemmVariant)("float16", nb, tw, depth, True).smem_bytes
    plan = GemmPlan(wgmma=bool(wgmma), token_blocks=nb, tiles=tw, depth=depth, aligned=aligned_groups(group_size, NG),
                    grid=(n_ctas, splits, m_tiles), splits=splits, per=per, smem=smem, NT16=NT16, ksplit=ksplit)
    # two K streams take a tail where forced (tests, A/B runs) or, with _KSPLIT_TMA_TAILS, where the model says so
    # (the ksplit=None path above asks for that only in place of a split plan)
    two_tail = ksplit == 2 and (tail is True or _KSPLIT_TMA_TAILS)
    if (tail is False or not wgmma or (ksplit != 1 and not two_tail) or batch_invariant or splits_forced
            or nb < _TAIL_MIN_NB):
        return plan
    unit = 16 * GEMM_WARPS // ksplit * tw     # channels per column tile
    kw = dict(resident=res, M=M, Np=Np, stage_us=_unit_us(nb, tw, wgmma) / ksplit, min_per=2 * ksplit,
              per_sm=res // sm_count, share=share, cols_per_tile=unit)
    if wgmma:   # two CTAs per SM: the tensor cores shared, a lone CTA faster (PAIR_TAILS)
        kw.update(pair_sm_terms(nb, tw, ksplit, res // sm_count))
    t_tail, first, t_splits, t_per = tail_split_cost(KS, n_ctas, m_tiles, **kw)
    gain = _TAIL_GAIN if tail_gain is None else tail_gain
    if first == 0 or (tail is None and not t_tail < gain * split_cost(KS, n_ctas, m_tiles, **{
            k: v for k, v in kw.items() if k != "cols_per_tile"})[0]):
        return plan
    return dataclasses.replace(plan, grid=(first, 1, m_tiles), splits=1, per=KS,
                               tail=TailSplit(n_ctas - first, t_splits, t_per))


# A tail launch is planned only where it is modelled at least 2% faster than the one-launch plan. The model is
# about 1-2 points optimistic for tails (H100 A/B over ten grids, docs/design.md §Split-K reduce): the four it
# gave 2.4-2.9% all measured faster (0.5-6%), the six it gave 0.5-1.8% from 1.1% slower to 1.4% faster, and a
# near tie is not worth the changed sums.
_TAIL_GAIN = 0.98
# Token tiles of at least this many blocks of 8 (128 rows): the smaller tiles' grids were not measured with a tail
_TAIL_MIN_NB = 16
# A second GEMM launch behind the first (PDL overlaps its start with the first's last CTAs)
_TAIL_LAUNCH_US = 1.0


@functools.lru_cache(maxsize=4096)
def tail_split_cost(K_stages: int, n_ctas: int, m_tiles: int, *, resident: int, M: int, Np: int, stage_us: float,
                    min_per: int, per_sm: int, share: float, cols_per_tile: int,
                    tensor_us: float = 0.0, lone: float = 0.0,
                    first: int | None = None) -> tuple[float, int, int, int]:
    """(modelled us, first tail column tile, tail splits, units per tail split) of the fused GEMM run as whole waves
    of unsplit column tiles, then the other column tiles split K ways in a second launch (the split and its
    partials and reduce modelled by ``split_cost`` over those tiles' columns). Grids that are one wave or less, or
    whose remainder does not split, give ``first`` = 0 (no tail plan). The wave count of the first launch is
    searched too: one wave fewer can leave a tail that splits better. ``tensor_us`` and ``lone`` as for
    ``split_cost``; ``first``: the time of a plan whose tail starts at that column tile (no search; its split as
    modelled)."""
    per_sm = max(1, per_sm)
    tiles = n_ctas * m_tiles
    full = tiles // resident
    wave_us = K_stages * max(stage_us * (1 + share * (per_sm - 1)), tensor_us * per_sm)
    best = (float("inf"), 0, 1, K_stages)
    search = first is None
    for first in (w * resident // m_tiles for w in range(1, full + 1)) if search else (first,):
        if not 0 < first < n_ctas:
            continue
        main = -(-first * m_tiles // resident) * wave_us
        cols = min(Np - first * cols_per_tile, (n_ctas - first) * cols_per_tile)
        t, splits, per = split_cost(K_stages, n_ctas - first, m_tiles, resident=resident, M=M, Np=cols,
                                    stage_us=stage_us, min_per=min_per, per_sm=per_sm, share=share,
                                    tensor_us=tensor_us, lone=lone)
        if splits < 2 and search:
            continue
        t += main + _TAIL_LAUNCH_US
        if t < best[0] - 1e-9:
            best = (t, first, splits, per)
    return best


# M rows that overrun whole 256-token tiles by r rows pay for a whole further tile: M = 257 costs what M = 512 does.
# Running the r rows as a call of their own (a smaller token tile, or the GEMV) is planned where the split-K model
# gives the two calls at most _ROW_SPLIT_GAIN of the one call's time. The margin covers what the model leaves out:
# the second call's x tile pass and launch gaps, and the remainder's small grids, which the model underestimates
# (H200 sweep over both benchmark models, M = 257..1536, bench/sweeps/token_tiles.py; docs/design.md §Row split).
_ROW_SPLIT_GAIN = 0.9
# That sweep modelled the one call with the tails planned then, at 3% modelled gain. Tails between that and
# _TAIL_GAIN would tip calls the sweep found faster split (Mistral-7B gate_up at M = 1100: the two calls 406.8 us
# against 440.2 for the one call, whose tail measured 2.7% faster), so the comparison keeps its fitted tails.
_ROW_SPLIT_TAIL_GAIN = 0.97


def gemm_modelled_us(plan: GemmPlan, M: int, K: int, N: int, dtype: str, sm_count: int,
                     resident: Callable[[object, int], int]) -> float:
    """The split-K cost model's time for ``plan`` (a planned, not forced, GEMM plan for M rows of K x N): its
    kernel's unit time over its grid on the CTAs the GPU holds of its variant (``resident`` as for
    ``plan_gemm_launch``), the tail launch's model where it has one."""
    from .kernels import GEMM_WARPS
    from .layout import padded_sizes

    Kp, Np = padded_sizes(K, N)
    per_sm = max(1, resident(plan.variant(dtype), plan.smem))
    kw = dict(resident=per_sm * sm_count, M=M, Np=Np, per_sm=per_sm, min_per=2 * plan.ksplit,
              stage_us=_unit_us(plan.token_blocks, plan.tiles, plan.wgmma) / plan.ksplit,
              share=_WG_SHARE if plan.wgmma else _SHARE)
    # CTAs sharing an SM (the 128-token tile's PEND 2 variant) share its tensor cores: without this bound the model
    # times that variant's grids ~1.5x too fast (docs/design.md §Row split)
    kw["tensor_us"] = _wg_tensor_us(plan.token_blocks, plan.tiles) / plan.ksplit if plan.wgmma else 0.0
    if plan.wgmma:   # and a lone CTA's unit (PAIR_TAILS)
        kw.update(pair_sm_terms(plan.token_blocks, plan.tiles, plan.ksplit, per_sm))
    if plan.tail is None:
        return split_cost(Kp // 64, plan.grid[0], plan.grid[2], **kw)[0]
    return tail_split_cost(Kp // 64, plan.grid[0] + plan.tail.ctas, plan.grid[2], first=plan.grid[0],
                           cols_per_tile=16 * GEMM_WARPS // plan.ksplit * plan.tiles, **kw)[0]


def row_split(M: int, K: int, N: int, group_size: int, dtype: str, arch, sm_count: int,
              resident: Callable[[object, int], int]) -> int:
    """Rows of the first call where matmul's M rows run as two calls (``RowSplit``): M rounded down to whole
    256-token tiles, where the model times the two calls' GEMMs at most ``_ROW_SPLIT_GAIN`` of the one call's; 0
    for one call. Only for the wgmma GEMM beyond its largest token tile; the rest is modelled as the fused GEMM even
    where it runs the GEMV (which matmul takes only where it is faster)."""
    from .kernels import GEMM_WG_DEFAULT

    tile = max(GEMM_WG_DEFAULT)
    rows = M - M % tile
    if rows == 0 or rows == M or not uses_wgmma(arch, M):
        return 0

    def cost(m: int) -> float:   # PEND 2 for its own grid left out: the model times those grids several percent
        # faster than measured (Mistral-7B down at M = 128: 5.5% against 0.6%), which would flip splits the sweep
        # checked; where the rest does take it, it runs no slower than modelled here
        p = plan_gemm_launch(m, K, N, group_size, dtype, arch, sm_count, resident, pend_own_grid=False,
                             tail_gain=_ROW_SPLIT_TAIL_GAIN)
        return gemm_modelled_us(p, m, K, N, dtype, sm_count, resident)

    return rows if cost(rows) + cost(M - rows) < _ROW_SPLIT_GAIN * cost(M) else 0


# Two K streams per CTA replace a two-way split-K on token tiles of at least _KSPLIT_MIN_NB blocks of 8 when each
# stream has at most _KSPLIT_MAX_UNITS 64-k units, and halve a four-way split on one tile of _KSPLIT_FOUR_MIN_NB.
_KSPLIT_MIN_NB = 16
_KSPLIT_MAX_UNITS = 16
_KSPLIT_FOUR_MIN_NB = 32
# Where the GEMM reads x through the tensor map (_KSPLIT_TMA), two K streams are planned where the split-K model
# times them at most _KSPLIT_TMA_GAIN of the one-stream plan and each stream has at most _KSPLIT_TMA_SPLIT_UNITS
# 64-k units in place of a split plan (fewer or no fp32 partials), at most _KSPLIT_TMA_WAVE_UNITS in place of an
# unsplit one or a split tail (a grid that fills its last wave better). H100 A/B (docs/design.md §wgmma GEMM
# (gemm_wg)): in place of splits they won at 56, 64 and 112 units per stream and lost at 224 (Llama-2-70B down); in
# place of a tail they won at 32 (Mistral-7B qkv M = 1024, o 1536) and lost at 64 and 112.
_KSPLIT_TMA, _KSPLIT_TMA_GAIN = True, 0.97
_KSPLIT_TMA_SPLIT_UNITS, _KSPLIT_TMA_WAVE_UNITS = 112, 32
# Whether those two-stream plans may end in a split tail launch (whole waves of unsplit two-stream CTAs, then the
# rest split K ways), taken only in place of a one-stream plan that splits K over its whole grid. H100 A/B
# (docs/design.md §Split-K reduce): in place of splits they won 7-9% (Mistral-7B down M = 768, Llama-2-70B qkv
# M = 256); in place of an unsplit plan or a one-stream tail they lost 1-14% in all seven cells tried, where the
# model gave them 2-8%.
_KSPLIT_TMA_TAILS = True


def two_streams_considered(M: int, N: int, shape: tuple, batch_invariant: bool = False) -> bool:
    """Whether the planner weighs two K streams against the one-stream plan by the model (``_KSPLIT_TMA``): the
    wgmma GEMM of ``shape`` has a two-stream variant and reads x through the tensor map."""
    from .kernels import GEMM_WG_KSPLIT_SHAPES

    return _KSPLIT_TMA and tuple(shape) in GEMM_WG_KSPLIT_SHAPES and x_by_tensor_map(M, N, shape, batch_invariant)


def two_streams_win(one_splits: int, two_per: int, t_one: float, t_two: float) -> bool:
    """``_KSPLIT_TMA``'s choice: two K streams (``two_per`` units per split, half of them per stream, modelled
    ``t_two``) over a one-stream plan of ``one_splits`` splits (1 for an unsplit plan or a split tail, modelled
    ``t_one``), within the measured stream lengths."""
    most = _KSPLIT_TMA_SPLIT_UNITS if one_splits > 1 else _KSPLIT_TMA_WAVE_UNITS
    return two_per // 2 <= most and t_two < _KSPLIT_TMA_GAIN * t_one


def wgmma_ksplit(plan: GemmPlan, wgmma: bool, batch_invariant: bool = False, forced_splits: bool = False) -> int:
    """K streams per CTA for a one-stream GEMM ``plan``: 2 where it splits K two ways on a token tile of 128 or more
    and each stream would run at most 16 units (K <= 4096), or four ways on one 256-token tile, else 1; with 2,
    ``plan_gemm`` halves the split count. Two streams run the same CTAs (twice the column tiles of half the
    channels) with half the splits: fewer fp32 partials (none in place of two splits, and no reduce kernel), but
    each unit's x tile is copied for 64 channels instead of 128 and each stream has half the x slots, so the saving
    is fixed and the cost grows with the units. Measured on the H200 (docs/design.md §wgmma GEMM (gemm_wg)): in
    place of two splits ~10% faster on Mistral-7B qkv at M = 256 and o at M = 512, ~1% at 16 units per stream (qkv
    M = 128); with more units per stream it won a few percent or lost up to ~13% (Mistral-7B down, Llama-2-70B o
    and down). Where ``plan_gemm`` plans a split tail launch instead of the two-way split, the tail is taken (it ran
    ~18% faster than two streams on Mistral-7B qkv at M = 640 and 768). In place of four splits, two streams with
    one split lost or tied, and without a split to replace they lost more (~17%, gate_up M = 256); two streams x
    two splits won on the H100 at M = 256 (Mistral-7B o 23.2 -> 21.1 us, 16 units per stream; down 52.9 -> 50.8,
    56 units) and lost at M = 512, so they are planned here on one 256-token tile only (M = 129..256). Where x goes
    through the tensor map, ``plan_gemm`` also weighs two streams against this rule's plan by the split-K model
    (``_KSPLIT_TMA``). Batch-invariant calls and forced split counts keep one stream."""
    if not wgmma or batch_invariant or forced_splits:
        return 1
    if plan.splits == 4 and plan.token_blocks >= _KSPLIT_FOUR_MIN_NB and plan.grid[2] == 1:
        return 2
    if plan.splits != 2 or plan.token_blocks < _KSPLIT_MIN_NB:
        return 1
    return 2 if plan.per <= 2 * _KSPLIT_MAX_UNITS else 1


def wgmma_pend(shape: tuple[int, int, int], ctas: int | None, sm_count: int,
               batch_invariant: bool = False) -> int | None:
    """The wgmma GEMM's PEND variant other than the default for ``shape`` (kernels.GEMM_WG_PEND_TWO_PER_SM), or
    None: the shape's two-CTAs-per-SM variant where a grid of ``ctas`` has more CTAs than SMs (None: whether the
    shape has one at all). ``plan_gemm_launch`` asks with the larger of two planned grids, the default PEND's (one
    CTA per SM) and the two-per-SM variant's, whose split count may fill the second slot of each SM (the latter
    only where its splits are long enough, ``_PEND_TWO_MIN_UNITS``): one CTA per SM keeps the deeper wgmma queue,
    so the variant is taken only where it runs two (measured at ``PEND_TWO_OWN_GRID``). Both PENDs run the same
    wgmmas in the same order (same bits); batch-invariant calls keep the default."""
    from .kernels import GEMM_WG_PEND_TWO_PER_SM

    two = GEMM_WG_PEND_TWO_PER_SM.get(tuple(shape))
    if two is None or batch_invariant:
        return None
    return two if ctas is None or ctas > sm_count else None


def reduce_columns(M: int, N: int, sm_count: int) -> int:
    """Columns per thread of the split-K reduce kernel for an M x N output: 8 while that still gives every SM four
    blocks of 256 threads, else 4 while it gives two, else 2 (a small output needs the threads for its loads in
    flight). H200, Mistral-7B (docs/design.md §Split-K reduce): o at M = 256 (four blocks per SM with 4 columns, two
    with 8) is ~6% faster with 4 than with 8, at M = 512 ~2% faster with 8; down at M = 64 ~4% faster with 2 than
    with 4."""
    if M * N // 8 >= 4 * 256 * sm_count:
        return 8
    if M * N // 4 >= 2 * 256 * sm_count:
        return 4
    return 2


def x_tile_chunks(M: int, K: int, BM: int) -> int:
    """16-byte chunks of the wgmma GEMM's x tiles for M rows of K (token tiles of BM rows, 64-k units): what
    awq_tile_x_kernel writes. Its index arithmetic (shifts by BM, a power of two, and one 32-bit multiply-shift
    division of the (token tile, unit) index) needs fewer than 2^31 (token tile, unit) pairs, i.e. M x K below
    2^41 elements with 16-token tiles (2^45 with 256-token ones); beyond that a clear error."""
    if BM < 8 or BM & (BM - 1):
        raise ValueError(f"x tiles: the token tile ({BM} rows) must be a power of two of at least 8")
    pairs = -(-M // BM) * -(-K // 64)
    if pairs >= 2**31:
        raise ValueError(f"x has {M} rows of K={K}: the fused GEMM's x tile pass handles fewer than 2^31 (token "
                         f"tile, 64-k unit) pairs ({pairs} here); split the rows into smaller calls")
    return pairs * BM * 8


_sm_counts: dict = {}
