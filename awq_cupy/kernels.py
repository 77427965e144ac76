"""The kernel table: every kernel family awq_cupy ships, and the variants it instantiates per arch.

A variant is a small frozen object (``GemvVariant``, ``GemmVariant``, ``WgmmaVariant``, ...) that names its family
and renders its C++ template arguments (``expr``); launch sizes that mirror the C++ (shared memory, warps per
CTA) are methods of the variant and are proved equal to the kernel's own at compile time: each family appends one
``static_assert`` per variant to its source (``asserts``), so a disagreement fails the compile check in CI.
``python -m awq_cupy compile`` and the tests iterate over ``FAMILIES``; the launch code gets kernels through
``kernel(variant)``. Adding a variant or an architecture: docs/design.md §Adding a variant or an architecture.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

from .jit import Arch, KernelFamily, get_kernel

# C++ element type names of the activation / scale dtypes.
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def gemm_dtypes(arch: Arch) -> tuple[str, ...]:
    """Activation dtypes the tensor-core kernels support on ``arch`` (bf16 mma needs ``mma_k16``)."""
    return ("float16", "bfloat16") if arch.mma_k16 else ("float16",)


def _bool(v: bool) -> str:
    return "true" if v else "false"


@dataclass(frozen=True)
class Variant:
    """One template instantiation of a family's kernel: ``expr`` is the C++ name expression NVRTC lowers."""

    family: ClassVar[str]
    template: ClassVar[str]

    def template_args(self) -> tuple[str, ...]:
        return ()

    @property
    def expr(self) -> str:
        args = self.template_args()
        return f"{self.template}<{', '.join(args)}>" if args else self.template


    def asserts(self, arch: Arch) -> tuple[str, ...]:
        """C++ static_assert lines proving that this object's launch sizes are the kernel's own."""
        return ()


@dataclass(frozen=True)
class Plain(Variant):
    """A kernel without template arguments (the repack and timing kernels). Build it with keywords: the field
    ``family`` keeps the base class's position, before ``name``."""

    name: str
    family: str

    @property
    def expr(self) -> str:
        return self.name


# --------------------------------------------------------------------------------------------------------------
# Dequantize and repack (kernels_cu/dequant.cu, repack.cu)
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DequantVariant(Variant):
    """``dequantize`` of the checkpoint's gemm packing: ``out_dtype`` results from ``scale_dtype`` scales."""

    family: ClassVar[str] = "dequant"
    template: ClassVar[str] = "awq_dequant_gemm_kernel"
    out_dtype: str
    scale_dtype: str

    def template_args(self):
        return CTYPE[self.out_dtype], CTYPE[self.scale_dtype]


@dataclass(frozen=True)
class _OneDtype(Variant):
    """A kernel whose one template argument is the activation type."""

    dtype: str

    def template_args(self):
        return (CTYPE[self.dtype],)


@dataclass(frozen=True)
class DequantTilesVariant(_OneDtype):
    """``dequantize`` of the repacked tiles (the dense weights of the dequantize + cuBLAS path)."""

    family: ClassVar[str] = "dequant"
    template: ClassVar[str] = "awq_dequant_tiles_kernel"


DEQUANT = KernelFamily("dequant", "dequant.cu",
                       lambda arch: tuple(DequantVariant(o, s) for o in CTYPE for s in CTYPE)
                       + tuple(DequantTilesVariant(d) for d in gemm_dtypes(arch)), hot=True)

REPACK_KERNEL = Plain(name="awq_repack_gemm_to_tiles_kernel", family="repack")
REPACK = KernelFamily("repack", "repack.cu", lambda arch: (REPACK_KERNEL,), hot=False)

# --------------------------------------------------------------------------------------------------------------
# mma.sync GEMM and the split-K reduce (kernels_cu/gemm_tc.cu; every arch)
# --------------------------------------------------------------------------------------------------------------
REDUCE_COLUMNS = (2, 4, 8)   # columns per thread of awq_splitk_reduce_kernel


@dataclass(frozen=True)
class ReduceVariant(Variant):
    """The split-K reduce: fp32 partial sums of ``splits`` -> outputs, ``columns`` per thread."""

    family: ClassVar[str] = "gemm_tc"
    template: ClassVar[str] = "awq_splitk_reduce_kernel"
    dtype: str
    columns: int = 8

    def template_args(self):
        return CTYPE[self.dtype], str(self.columns)


# (token blocks of 8, 16-column blocks per warp, units in registers): one shape per token tile, the fastest of
# the sweep on the H200 (docs/design.md §mma.sync GEMM (gemm_tc)).
GEMM_SHAPES = ((2, 2, 5), (4, 2, 4), (8, 2, 3), (16, 1, 3))
GEMM_DEFAULT = {8 * s[0]: s for s in GEMM_SHAPES}
GEMM_WARPS = 8   # warps per CTA of both GEMMs (awq_sw::WARPS, awq_wg::WARPS)


@dataclass(frozen=True)
class GemmVariant(Variant):
    """awq_gemm_sw_kernel: ``token_blocks`` of 8 rows, ``tiles`` 16-column blocks per warp, ``depth`` units in
    registers, ``aligned``: scale groups of whole 64-k blocks."""

    family: ClassVar[str] = "gemm_tc"
    template: ClassVar[str] = "awq_gemm_sw_kernel"
    dtype: str
    token_blocks: int
    tiles: int
    depth: int
    aligned: bool

    def template_args(self):
        return (CTYPE[self.dtype], str(self.token_blocks), str(self.tiles), str(self.depth), _bool(self.aligned))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: two x slots of 8 NB rows x 64 k of 2 bytes."""
        return 2 * 8 * self.token_blocks * 64 * 2

    @property
    def threads(self) -> int:
        """Threads per CTA: GEMM_WARPS warps."""
        return 32 * GEMM_WARPS

    def asserts(self, arch: Arch) -> tuple[str, ...]:
        return (f"static_assert(awq_sw::smem_bytes<{self.token_blocks}>() == {self.smem_bytes}, "
                f"\"awq_cupy.kernels.GemmVariant.smem_bytes\");",)


def _asserts_of(variants):
    """A family's ``asserts``: every variant's checks, each once."""
    return lambda arch: tuple(dict.fromkeys(a for v in variants(arch) for a in v.asserts(arch)))


def _gemm_variants(arch: Arch) -> tuple:
    dtypes = gemm_dtypes(arch)
    return (tuple(ReduceVariant(d, c) for d in dtypes for c in REDUCE_COLUMNS)
            + tuple(GemmVariant(d, nb, tw, p, ga) for d in dtypes for nb, tw, p in GEMM_SHAPES
                    for ga in (True, False)))


GEMM_TC = KernelFamily("gemm_tc", "gemm_tc.cu", _gemm_variants, hot=True, asserts=_asserts_of(_gemm_variants))

# --------------------------------------------------------------------------------------------------------------
# Swapped-operand tensor-core GEMV for M <= 32 (kernels_cu/gemv_tc.cu)
# --------------------------------------------------------------------------------------------------------------
GEMV_TOKEN_BLOCKS = (1, 2, 3, 4)
# (token blocks, tiles) built on every arch, with and without aligned groups (docs/design.md §GEMV (gemv_tc))
GEMV_SHAPES = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4))
# Three and four token blocks (M = 17..32): where the arch has ``gemv_wide``, for groups of whole 64-k blocks
# only. (3, 1) spills at its 512-thread bound and (4, 4) at 256, so they are not built.
GEMV_WIDE_SHAPES = ((3, 2), (3, 3), (3, 4), (4, 1), (4, 2), (4, 3))
# Also built with two 64-k blocks per unit (KD = 2, groups of whole 64-k blocks only): a unit of pairs then holds
# as many blocks as one of fours, without the fours' column padding.
GEMV_KD2_SHAPES = ((1, 2), (2, 2))


def gemv_wide_shapes(arch: Arch) -> tuple[tuple[int, int], ...]:
    """The three- and four-token-block GEMV variants built for ``arch`` (for groups of whole 64-k blocks)."""
    return GEMV_WIDE_SHAPES if arch.gemv_wide else ()


def gemv_shapes(arch: Arch, aligned: bool = True) -> tuple[tuple[int, int], ...]:
    """The (token blocks, tiles) GEMV variants built for ``arch`` (``aligned``: groups of whole 64-k blocks)."""
    return GEMV_SHAPES + (gemv_wide_shapes(arch) if aligned else ())


@dataclass(frozen=True)
class GemvVariant(Variant):
    """awq_gemv_tc_kernel: ``token_blocks`` of 8 rows per mma, ``tiles`` 16-column blocks per warp unit,
    ``aligned``: scale groups of whole 64-k blocks, ``kdepth`` 64-k blocks per unit."""

    family: ClassVar[str] = "gemv_tc"
    template: ClassVar[str] = "awq_gemv_tc_kernel"
    dtype: str
    token_blocks: int
    tiles: int
    aligned: bool = True
    kdepth: int = 1

    def __post_init__(self):
        if self.kdepth not in (1, 2) or (self.kdepth == 2 and not self.aligned):
            raise ValueError(f"GEMV kdepth={self.kdepth!r}: 1, or 2 with aligned groups")

    def template_args(self):
        args = (CTYPE[self.dtype], str(self.token_blocks), str(self.tiles), _bool(self.aligned))
        return args + ((str(self.kdepth),) if self.kdepth != 1 else ())

    @property
    def scaled(self) -> bool:
        """Whether the variant multiplies by the rounded weights T((q - z) * s), like the GEMMs and
        ``dequantize`` (``awq_gemv::Scaled``: the plain pairs at two token blocks), instead of the exact (q - z)
        with the scales applied to fp32 group sums (every other variant)."""
        return self.token_blocks == 2 and self.tiles == 2 and self.kdepth == 1

    @property
    def one_slot(self) -> bool:
        """Whether the variant keeps one fp32 partial slot per warp instead of two (``awq_gemv::OneSlot``: two
        token blocks with three or four blocks per unit)."""
        return self.token_blocks == 2 and self.tiles >= 3

    def max_warps(self, arch: Arch) -> int:
        """Warps per CTA the variant is compiled for (``awq_gemv::Bounds``, by blocks per unit = tiles x
        kdepth)."""
        if self.scaled and arch.gemv_scaled_16_warps:
            return 16
        blocks = self.tiles * self.kdepth
        if blocks * self.token_blocks >= 8:
            return 8
        if blocks * self.token_blocks >= 4 or (blocks == 3 and not self.aligned):
            return arch.gemv_mid_warps
        return 16

    def smem_bytes(self, warps: int) -> int:
        """Dynamic shared memory for ``warps`` warps: fp32 partial slots of 32 lanes x tiles x token blocks x
        float4, two per warp (one where ``one_slot``)."""
        slots = warps if self.one_slot else 2 * warps
        return slots * 32 * self.tiles * self.token_blocks * 4 * 4

    def asserts(self, arch: Arch) -> tuple[str, ...]:
        nb, tw, kd = self.token_blocks, self.tiles, self.kdepth
        most = self.max_warps(arch)
        bounds = f"awq_gemv::Bounds<{nb}, {tw * kd}, {_bool(self.aligned)}, {_bool(self.scaled)}>::threads"
        return (f"static_assert({bounds} == {32 * most}, \"awq_cupy.kernels.GemvVariant.max_warps\");",
                f"static_assert(awq_gemv::Scaled<{nb}, {tw}, {kd}>::value == {_bool(self.scaled)}, "
                f"\"awq_cupy.kernels.GemvVariant.scaled\");",
                f"static_assert(awq_gemv::smem_bytes<{nb}, {tw}>({most}) == {self.smem_bytes(most)}, "
                f"\"awq_cupy.kernels.GemvVariant.smem_bytes\");")


def _gemv_variants(arch: Arch) -> tuple[GemvVariant, ...]:
    dtypes = gemm_dtypes(arch)
    return (tuple(GemvVariant(d, nb, tw, ga) for d in dtypes for nb, tw in GEMV_SHAPES for ga in (True, False))
            + tuple(GemvVariant(d, nb, tw, True, 2) for d in dtypes for nb, tw in GEMV_KD2_SHAPES)
            + tuple(GemvVariant(d, nb, tw, True) for d in dtypes for nb, tw in gemv_wide_shapes(arch)))


GEMV_TC = KernelFamily("gemv_tc", "gemv_tc.cu", _gemv_variants, hot=True, asserts=_asserts_of(_gemv_variants))

# The GEMV's shape arguments after M (awq_cupy.plans.gemv_shape_args), as the AWQ_GEMV_<name> defines of a variant
# compiled for one launch shape (kernels_cu/gemv_tc.cu AWQ_GEMV_SHAPE).
GEMV_SHAPE_ARGS = ("N", "K", "NT16", "KS", "G", "NG", "NP", "FD_GRID", "FD_W", "FD_KQ", "FD_G")


def gemv_shape_family(variant: GemvVariant, shape_args: tuple, warps: int,
                      extra_defines: tuple[tuple[str, str], ...] = (), tokens: int | None = None) -> KernelFamily:
    """The GEMV family with one variant, compiled for one launch shape: ``shape_args`` are the kernel's arguments
    after M (``plans.gemv_shape_args``: N, K, NT16, KS, G, NG, Np and the four fast dividers) and ``warps`` its
    warps per CTA; ``tokens``, if given, fixes M as well (``plans.gemv_compiled_tokens``). The launch must pass the
    same values. One NVRTC compile (~0.3-0.5 s) per shape, then the disk cache. ``extra_defines`` (e.g.
    AWQ_GEMV_TRACE) are added. One family object per distinct set of values (cached)."""
    if not isinstance(variant, GemvVariant):
        raise TypeError(f"gemv_shape_family takes a GemvVariant, got {type(variant).__name__}")
    if len(shape_args) != len(GEMV_SHAPE_ARGS):
        raise ValueError(f"GEMV shape: {len(GEMV_SHAPE_ARGS)} arguments {GEMV_SHAPE_ARGS}, got {shape_args!r}")
    vals = tuple(int(v) for v in shape_args)
    if tokens is not None and not 1 <= tokens <= 8 * variant.token_blocks:
        raise ValueError(f"GEMV tokens={tokens!r}: 1 to 8 per token block of variant {variant.expr}")
    return _gemv_shape_family(variant, vals, int(warps), tuple(extra_defines), tokens)


@functools.lru_cache(maxsize=None)
def _gemv_shape_family(variant, vals, warps, extra_defines, tokens) -> KernelFamily:
    defines = (("AWQ_GEMV_SHAPE", "1"), ("AWQ_GEMV_W", str(warps))) + tuple(
        (f"AWQ_GEMV_{n}", f"{v}ull" if n.startswith("FD_") else str(v)) for n, v in zip(GEMV_SHAPE_ARGS, vals))
    if tokens is not None:
        defines += (("AWQ_GEMV_M", str(tokens)),)
    name = (f"gemv_tc:{variant.expr}:w{warps}:" + "-".join(map(str, vals)) + (f":m{tokens}" if tokens else "")
            + "".join(f":{d}" for d, _ in extra_defines))
    return dataclasses.replace(GEMV_TC, name=name, defines=defines + extra_defines,
                               variants=lambda arch, v=variant: (v,), asserts=None)


# --------------------------------------------------------------------------------------------------------------
# Hopper warpgroup-MMA GEMM (kernels_cu/gemm_wg.cu, sm_90a only)
# --------------------------------------------------------------------------------------------------------------
# (token blocks of 8 = wgmma N / 8, 16-column blocks per warp, units in registers); 8 warps per CTA. One block per
# warp with 6 units in registers (two CTAs per SM) is the fastest shape of the 16-, 32- and 64-token tiles
# (docs/design.md §wgmma GEMM (gemm_wg)).
GEMM_WG_SHAPES = ((2, 2, 5), (2, 1, 6), (4, 2, 4), (4, 1, 6), (8, 2, 4), (8, 1, 6), (16, 2, 3), (16, 1, 4),
                  (32, 1, 4))
GEMM_WG_DEFAULT = {16: (2, 1, 6), 32: (4, 1, 6), 64: (8, 1, 6), 128: (16, 1, 4), 256: (32, 1, 4)}
GEMM_WG_SLOTS = 6   # x slots of awq_gemm_wg_kernel (awq_wg::SLOTS)
GEMM_WG_PRODUCER_WARPS = 4   # x producer warps of the variants that have them (awq_wg::PRODUCER_WARPS)
# Shapes with x-producer variants (awq_wg::producers_fit): 128 and 256 tokens, one block per warp, one CTA per SM
GEMM_WG_PRODUCER_SHAPES = ((16, 1, 4), (32, 1, 4))


def has_producers(shape) -> bool:
    """Whether a wgmma shape (token blocks, tiles, depth) has x-producer variants (at its default PEND)."""
    return tuple(shape) in GEMM_WG_PRODUCER_SHAPES

# Shapes with tensor-map variants (awq_gemm_wg_tma_kernel: x read as it is, no x tile pass): the 128- and 256-token
# tiles, at each of their PENDs and K stream counts
GEMM_WG_TMA_SHAPES = ((16, 1, 4), (32, 1, 4))


def has_tma(shape) -> bool:
    """Whether a wgmma shape (token blocks, tiles, depth) has tensor-map variants."""
    return tuple(shape) in GEMM_WG_TMA_SHAPES

# The 128-token tile also has a PEND = 2 variant that fits 128 registers, so two CTAs share an SM: faster where the
# grid has more CTAs than SMs, slower with one CTA per SM; plans.plan_gemm_launch picks by the planned grid.
# {(token blocks, tiles, depth): PEND}
GEMM_WG_PEND_TWO_PER_SM = {(16, 1, 4): 2}


def gemm_wg_pend(token_blocks: int) -> int:
    """wgmma groups each warpgroup leaves pending per k16 step (the kernel's PEND default): 3 from 128 tokens,
    where the wgmma latency is long against the tile's k step, 1 below."""
    return 3 if token_blocks >= 16 else 1


def gemm_wg_pends(shape) -> tuple:
    """PEND values instantiated for a wgmma shape: the default (None), and the two-per-SM one where it has one."""
    return (None,) + ((GEMM_WG_PEND_TWO_PER_SM[shape],) if shape in GEMM_WG_PEND_TWO_PER_SM else ())


@dataclass(frozen=True)
class WgmmaVariant(Variant):
    """awq_gemm_wg_kernel: the shape as for ``GemmVariant``; ``pend``: a PEND other than the tile's default (None:
    the default; a value equal to it is stored as None), ``ksplit`` = 2: two K streams per CTA (template KW);
    ``producers``: GEMM_WG_PRODUCER_WARPS more warps copy x into shared memory inside the kernel, which then takes x
    [M, K] itself instead of awq_tile_x_kernel's tiles (template XP; shapes of GEMM_WG_PRODUCER_SHAPES at the
    default PEND only; docs/design.md §wgmma GEMM (gemm_wg)); ``tma``: awq_gemm_wg_tma_kernel, which reads x
    [M, K] through a tensor map (``driver.TensorMap``) and puts its weight words in x's k order (shapes of
    GEMM_WG_TMA_SHAPES)."""

    family: ClassVar[str] = "gemm_wg"
    template: ClassVar[str] = "awq_gemm_wg_kernel"
    dtype: str
    token_blocks: int
    tiles: int
    depth: int
    aligned: bool
    pend: int | None = None
    ksplit: int = 1
    producers: bool = False
    tma: bool = False

    def __post_init__(self):
        if self.pend == gemm_wg_pend(self.token_blocks):
            object.__setattr__(self, "pend", None)
        if self.ksplit not in (1, 2):
            raise ValueError(f"wgmma GEMM ksplit={self.ksplit!r}: 1 or 2")
        if self.producers and (self.pend is not None or not has_producers(self.shape)):
            raise ValueError(f"wgmma GEMM shape {self.shape} with PEND {self.pend}: x producers exist for the "
                             f"shapes {GEMM_WG_PRODUCER_SHAPES} at their default PEND only")
        if self.tma and (self.producers or not has_tma(self.shape)):
            raise ValueError(f"wgmma GEMM shape {self.shape}, producers={self.producers}: tensor-map variants exist "
                             f"for the shapes {GEMM_WG_TMA_SHAPES} without x producers")

    @property
    def expr(self) -> str:
        name = "awq_gemm_wg_tma_kernel" if self.tma else self.template
        return f"{name}<{', '.join(self.template_args())}>"

    @property
    def shape(self) -> tuple:
        return (self.token_blocks, self.tiles, self.depth)

    def template_args(self):
        args = (CTYPE[self.dtype], str(self.token_blocks), str(self.tiles), str(self.depth), _bool(self.aligned))
        if self.ksplit != 1 or self.producers:
            return args + (str(gemm_wg_pend(self.token_blocks) if self.pend is None else self.pend),
                           str(self.ksplit)) + (("true",) if self.producers else ())
        return args + ((str(self.pend),) if self.pend is not None else ())

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: GEMM_WG_SLOTS x slots of 8 NB rows x 128 B, plus 1 KB to align them."""
        return GEMM_WG_SLOTS * 8 * self.token_blocks * 128 + 1024

    @property
    def threads(self) -> int:
        """Threads per CTA: the GEMM_WARPS consumer warps, and the producer warps where it has them."""
        return 32 * (GEMM_WARPS + (GEMM_WG_PRODUCER_WARPS if self.producers else 0))

    def asserts(self, arch: Arch) -> tuple[str, ...]:
        return (f"static_assert(awq_wg::smem_bytes<{self.token_blocks}>() == {self.smem_bytes}, "
                f"\"awq_cupy.kernels.WgmmaVariant.smem_bytes\");",
                f"static_assert(awq_wg::cta_threads<{_bool(self.producers)}>() == {self.threads}, "
                f"\"awq_cupy.kernels.WgmmaVariant.threads\");")


@dataclass(frozen=True)
class TileXVariant(_OneDtype):
    """The wgmma GEMM's x pass: x as per-(token tile, 64-k unit) shared-memory images."""

    family: ClassVar[str] = "gemm_wg"
    template: ClassVar[str] = "awq_tile_x_kernel"


# Two K streams per CTA (KW = 2): the default shapes of the token tiles on which plans.wgmma_ksplit takes them
# (128 and 256 tokens).
GEMM_WG_KSPLIT_SHAPES = tuple(s for t, s in GEMM_WG_DEFAULT.items() if t >= 128)


def _wgmma_variants(arch: Arch) -> tuple:
    dtypes = gemm_dtypes(arch)
    return (tuple(WgmmaVariant(d, *s, ga, pend) for d in dtypes for s in GEMM_WG_SHAPES for ga in (True, False)
                  for pend in gemm_wg_pends(s))
            + tuple(WgmmaVariant(d, *s, ga, ksplit=2) for d in dtypes for s in GEMM_WG_KSPLIT_SHAPES
                    for ga in (True, False))
            + tuple(WgmmaVariant(d, *s, ga, ksplit=ks, producers=True) for d in dtypes
                    for s in GEMM_WG_PRODUCER_SHAPES for ks in (1, 2) for ga in (True, False))
            + tuple(WgmmaVariant(d, *s, ga, pend, ksplit=ks, tma=True) for d in dtypes for s in GEMM_WG_TMA_SHAPES
                    for ga in (True, False) for pend in gemm_wg_pends(s) for ks in ((1, 2) if pend is None else (1,)))
            + tuple(TileXVariant(d) for d in dtypes))


GEMM_WG = KernelFamily("gemm_wg", "gemm_wg.cu", _wgmma_variants, hot=True, needs=("wgmma",), arch_specific=True,
                       asserts=_asserts_of(_wgmma_variants))

# --------------------------------------------------------------------------------------------------------------
# Timing (kernels_cu/timing.cu): the benchmark's spin kernel
# --------------------------------------------------------------------------------------------------------------
SPIN_KERNEL = Plain(name="awq_spin_kernel", family="timing")
TIMING = KernelFamily("timing", "timing.cu", lambda arch: (SPIN_KERNEL,), hot=False)

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (DEQUANT, REPACK, GEMM_TC, GEMM_WG, GEMV_TC, TIMING)}


def kernel(variant: Variant, device_id: int | None = None):
    """The loaded kernel of ``variant`` (one of this module's variant objects) on the current (or given) device."""
    return get_kernel(FAMILIES[variant.family], variant, device_id)


def compile_all(archs=None, families=None, *, log=None, jobs: int | None = None):
    """Compile every variant of every family for every arch (no GPU needed).

    The (family, arch) compiles run on ``jobs`` threads (default: the CPU count; NVRTC releases the GIL, so two
    cores compile about twice as fast). Returns one row per (family, arch, variant), in table order:
    dict(family, arch, variant, registers, spill_stores, spill_loads, stack_frame, static_smem, hot, smem_limit,
    cached). Raises CompileError on the first failure.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    from .jit import ARCHS, compile_family

    archs = list(ARCHS) if archs is None else list(archs)
    unknown = [f for f in (families or ()) if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown kernel family {unknown[0]!r}; supported: {', '.join(FAMILIES)}")
    for a in archs:
        if a not in ARCHS:
            raise ValueError(f"unknown arch {a!r}; supported: {', '.join(ARCHS)}")
    fams = [FAMILIES[f] for f in (families or FAMILIES)]
    targets = [(fam, ARCHS[a]) for a in archs for fam in fams if fam.supports(ARCHS[a])]
    workers = max(1, min(len(targets) or 1, jobs or os.cpu_count() or 1))
    rows = []
    with ThreadPoolExecutor(workers) as pool:
        for (fam, arch), c in zip(targets, pool.map(lambda t: compile_family(*t), targets)):
            if log:
                log(f"{fam.name} {arch.target}: {len(c.lowered)} variants "
                    f"({'cache' if c.from_cache else f'{c.seconds:.1f}s'})")
            for v in c.lowered:
                r = c.resources.get(v)
                if r is None:
                    raise RuntimeError(f"no ptxas resource report for {fam.name} {v} on {arch.target}")
                rows.append(dict(family=fam.name, arch=arch.target, variant=v, hot=fam.hot,
                                 registers=r.registers, spill_stores=r.spill_stores, spill_loads=r.spill_loads,
                                 stack_frame=r.stack_frame, static_smem=r.static_smem,
                                 smem_limit=arch.smem_optin, cached=c.from_cache))
    return rows
