"""The kernel table: every kernel family awq_cupy compiles, and the variants it instantiates per arch.

This is the single place that lists template instantiations; ``python -m awq_cupy compile`` and the CI compile
check iterate over it, and the ops look kernels up through ``kernel(family, variant)``.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from .jit import Arch, KernelFamily, get_kernel

# C++ element type names of the activation / scale dtypes.
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def gemm_dtypes(arch: Arch) -> tuple[str, ...]:
    """Activation dtypes the tensor-core kernels support on ``arch`` (no bf16 mma before sm_80)."""
    return ("float16", "bfloat16") if arch.has_mma_k16 else ("float16",)


def _dequant_variants(arch: Arch) -> tuple[str, ...]:
    return tuple(f"awq_dequant_gemm_kernel<{CTYPE[o]}, {CTYPE[s]}>" for o in CTYPE for s in CTYPE) + tuple(
        dequant_tiles_variant(d) for d in gemm_dtypes(arch))


def dequant_tiles_variant(dtype: str) -> str:
    return f"awq_dequant_tiles_kernel<{CTYPE[dtype]}>"


DEQUANT = KernelFamily("dequant", "dequant.cu", _dequant_variants, hot=True)

REPACK = KernelFamily("repack", "repack.cu", lambda arch: ("awq_repack_gemm_to_tiles_kernel",), hot=False)


REDUCE_COLUMNS = (2, 4, 8)   # columns per thread of awq_splitk_reduce_kernel


def reduce_variant(dtype: str, columns: int = 8) -> str:
    return f"awq_splitk_reduce_kernel<{CTYPE[dtype]}, {columns}>"


# mma.sync GEMM (kernels_cu/gemm_tc.cu awq_gemm_sw_kernel, v12; every arch; sm_90 runs gemm_wg from 17 rows):
# (token blocks of 8, 16-column blocks per warp, units in registers) instantiated; 8 warps per CTA, 8 NB tokens per
# CTA; GA as for the GEMV. One shape per token tile (the H200 sweep, bench/gemm_sweep.py and NOTES.md v12).
GEMM_SHAPES = ((2, 2, 5), (4, 2, 4), (8, 2, 3), (16, 1, 3))
GEMM_DEFAULT = {8 * s[0]: s for s in GEMM_SHAPES}
GEMM_WARPS = 8


def gemm_sw_variant(dtype: str, token_blocks: int, tiles: int, depth: int, aligned: bool) -> str:
    return (f"awq_gemm_sw_kernel<{CTYPE[dtype]}, {token_blocks}, {tiles}, {depth}, "
            f"{'true' if aligned else 'false'}>")


def gemm_sw_smem_bytes(token_blocks: int) -> int:
    """Dynamic shared memory of awq_gemm_sw_kernel: two x slots of 8 NB rows x 64 k of 2 bytes."""
    return 2 * 8 * token_blocks * 64 * 2


def _gemm_variants(arch: Arch) -> tuple[str, ...]:
    return tuple(reduce_variant(d, c) for d in gemm_dtypes(arch) for c in REDUCE_COLUMNS) + tuple(
        gemm_sw_variant(d, nb, tw, p, ga) for d in gemm_dtypes(arch) for nb, tw, p in GEMM_SHAPES
        for ga in (True, False))


GEMM_TC = KernelFamily("gemm_tc", "gemm_tc.cu", _gemm_variants, hot=True)

# Swapped-operand tensor-core GEMV for M <= 32 (kernels_cu/gemv_tc.cu): token blocks of 8 per mma (NB), column
# groups of TW 16-column blocks per warp unit, one or two scale groups per 64-k unit (GA: groups span whole 64-k
# blocks, or there is one group), one or two units loaded ahead in registers. One CTA per SM of up to 16 warps (12
# when TW * NB >= 4 and for (1, 3) with two scale groups per unit, 8 when TW * NB >= 8: registers; the pairs at two
# token blocks decode scaled weights and run 16 on sm_90, gemv_scaled).
GEMV_TOKEN_BLOCKS = (1, 2, 3, 4)
GEMV_SHAPES = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4))   # (token blocks, tiles)
# Three and four token blocks (M = 17..32, "wide"): compute capability 9.0 only (measured there) and groups of whole
# 64-k blocks only. matmul takes them per layer shape (plans.gemv_wide_takes); (3, 1) spills at its 512-thread bound
# and (4, 4) at 256, so they are left out (bench/NOTES.md v40, v41).
GEMV_WIDE_SHAPES = ((3, 2), (3, 3), (3, 4), (4, 1), (4, 2), (4, 3))


def gemv_wide_shapes(arch: Arch) -> tuple[tuple[int, int], ...]:
    """The three- and four-token-block GEMV variants built for ``arch`` (for groups of whole 64-k blocks)."""
    return GEMV_WIDE_SHAPES if arch.cc >= 90 else ()


def gemv_shapes(arch: Arch, aligned: bool = True) -> tuple[tuple[int, int], ...]:
    """The (token blocks, tiles) GEMV variants built for ``arch`` (``aligned``: groups of whole 64-k blocks)."""
    return GEMV_SHAPES + (gemv_wide_shapes(arch) if aligned else ())
# Shapes also built with two 64-k blocks per unit (template KD = 2; groups of whole 64-k blocks only): a unit of
# pairs then holds as many block-units as one of fours, without the fours' padding (bench/NOTES.md v29).
GEMV_KD2_SHAPES = ((1, 2), (2, 2))


def gemv_scaled(token_blocks: int, tiles: int, kdepth: int = 1) -> bool:
    """Whether the GEMV variant multiplies by the rounded weights T((q - z) * s), like the GEMMs and ``dequantize``
    (``awq_gemv::Scaled`` in the kernel: the plain pairs at two token blocks), instead of the exact (q - z) with
    the scales applied to fp32 group sums (every other variant)."""
    return token_blocks == 2 and tiles == 2 and kdepth == 1


def gemv_max_warps(token_blocks: int, tiles: int, arch: Arch, aligned: bool = True, kdepth: int = 1) -> int:
    """Warps per CTA the variant is compiled for (``awq_gemv::Bounds`` in the kernel, by blocks per unit =
    tiles x kdepth; ``aligned``: GA)."""
    if gemv_scaled(token_blocks, tiles, kdepth) and arch.cc >= 90:
        return 16
    tiles *= kdepth
    if tiles * token_blocks >= 8:
        return 8
    if tiles * token_blocks >= 4 or (tiles == 3 and not aligned):
        return 8 if arch.cc < 80 else 12
    return 16


def gemv_one_slot(token_blocks: int, tiles: int) -> bool:
    """Whether the GEMV variant keeps one fp32 partial slot per warp instead of two (``awq_gemv::OneSlot`` in the
    kernel: two token blocks with three or four blocks per unit; bench/NOTES.md v39)."""
    return token_blocks == 2 and tiles >= 3


def gemv_smem_bytes(warps: int, token_blocks: int, tiles: int) -> int:
    """Dynamic shared memory of awq_gemv_tc_kernel: two fp32 partial slots per warp (one where gemv_one_slot)."""
    slots = warps if gemv_one_slot(token_blocks, tiles) else 2 * warps
    return slots * 32 * tiles * token_blocks * 4 * 4


def gemv_variant(dtype: str, token_blocks: int, tiles: int, aligned: bool, kdepth: int = 1) -> str:
    kd = f", {kdepth}" if kdepth != 1 else ""
    return f"awq_gemv_tc_kernel<{CTYPE[dtype]}, {token_blocks}, {tiles}, {'true' if aligned else 'false'}{kd}>"


GEMV_TC = KernelFamily("gemv_tc", "gemv_tc.cu",
                       lambda arch: tuple(gemv_variant(d, nb, tw, ga) for d in gemm_dtypes(arch)
                                          for nb, tw in GEMV_SHAPES for ga in (True, False))
                       + tuple(gemv_variant(d, nb, tw, True, 2) for d in gemm_dtypes(arch)
                               for nb, tw in GEMV_KD2_SHAPES)
                       + tuple(gemv_variant(d, nb, tw, True) for d in gemm_dtypes(arch)
                               for nb, tw in gemv_wide_shapes(arch)),
                       hot=True)

# The GEMV's shape arguments after M (awq_cupy.plans.gemv_shape_args), as the AWQ_GEMV_<name> defines of a variant
# compiled for one launch shape (kernels_cu/gemv_tc.cu AWQ_GEMV_SHAPE).
GEMV_SHAPE_ARGS = ("N", "K", "NT16", "KS", "G", "NG", "NP", "FD_GRID", "FD_W", "FD_KQ", "FD_G")


def gemv_shape_family(variant: str, shape_args: tuple, warps: int,
                      extra_defines: tuple[tuple[str, str], ...] = (), tokens: int | None = None) -> KernelFamily:
    """The GEMV family with one variant, compiled for one launch shape: ``shape_args`` are the kernel's arguments
    after M (``plans.gemv_shape_args``: N, K, NT16, KS, G, NG, Np and the four fast dividers) and ``warps`` its
    warps per CTA; ``tokens``, if given, fixes M as well (matmul: plans.gemv_compiled_tokens). The launch must pass
    the same values. One NVRTC compile (~0.3-0.5 s) per shape, then the disk cache. ``extra_defines`` (e.g.
    AWQ_GEMV_TRACE) are added. One family object per distinct set of values (cached)."""
    if len(shape_args) != len(GEMV_SHAPE_ARGS):
        raise ValueError(f"GEMV shape: {len(GEMV_SHAPE_ARGS)} arguments {GEMV_SHAPE_ARGS}, got {shape_args!r}")
    vals = tuple(int(v) for v in shape_args)
    nb = re.match(r"awq_gemv_tc_kernel<[^,]+,\s*(\d+),", variant)
    if tokens is not None and not (nb and 1 <= tokens <= 8 * int(nb.group(1))):
        raise ValueError(f"GEMV tokens={tokens!r}: 1 to 8 per token block of variant {variant}")
    return _gemv_shape_family(variant, vals, int(warps), tuple(extra_defines), tokens)


@functools.lru_cache(maxsize=None)
def _gemv_shape_family(variant, vals, warps, extra_defines, tokens) -> KernelFamily:
    defines = (("AWQ_GEMV_SHAPE", "1"), ("AWQ_GEMV_W", str(warps))) + tuple(
        (f"AWQ_GEMV_{n}", f"{v}ull" if n.startswith("FD_") else str(v)) for n, v in zip(GEMV_SHAPE_ARGS, vals))
    if tokens is not None:
        defines += (("AWQ_GEMV_M", str(tokens)),)
    name = (f"gemv_tc:{variant}:w{warps}:" + "-".join(map(str, vals)) + (f":m{tokens}" if tokens else "")
            + "".join(f":{d}" for d, _ in extra_defines))
    return dataclasses.replace(GEMV_TC, name=name, defines=defines + extra_defines,
                               variants=lambda arch, v=variant: (v,))


# Hopper warpgroup-MMA GEMM (kernels_cu/gemm_wg.cu, sm_90a only): (token blocks of 8 = wgmma N / 8, 16-column
# blocks per warp, units in registers); 8 warps per CTA; GA as for the GEMV.
# One 16-column block per warp with 6 units in registers (~90-105 registers: two CTAs per SM) is the fastest
# shape of the 16-, 32- and 64-token tiles (bench/NOTES.md v14).
GEMM_WG_SHAPES = ((2, 2, 5), (2, 1, 6), (4, 2, 4), (4, 1, 6), (8, 2, 4), (8, 1, 6), (16, 2, 3), (16, 1, 4),
                  (32, 1, 4))
GEMM_WG_DEFAULT = {16: (2, 1, 6), 32: (4, 1, 6), 64: (8, 1, 6), 128: (16, 1, 4), 256: (32, 1, 4)}
GEMM_WG_SLOTS = 6   # x slots of awq_gemm_wg_kernel (awq_wg::SLOTS)


# wgmma groups each warpgroup leaves pending per k16 step (the kernel's PEND default): 3 from 128 tokens, 1 below
# (bench/NOTES.md v20). The 128-token tile also has a PEND = 2 variant that fits 128 registers, so two CTAs share
# an SM: faster where the grid has more CTAs than SMs (gate_up at M = 128: 56 vs 65 us), slower with one CTA per SM
# (o: 22 vs 17 us); plans.plan_gemm_launch picks by the planned grid. {(token blocks, tiles, depth): PEND}
GEMM_WG_PEND_TWO_PER_SM = {(16, 1, 4): 2}


def gemm_wg_pend(token_blocks: int) -> int:
    return 3 if token_blocks >= 16 else 1


def gemm_wg_pends(shape) -> tuple:
    """PEND values instantiated for a wgmma shape: the default (None), and the two-per-SM one where it has one."""
    return (None,) + ((GEMM_WG_PEND_TWO_PER_SM[shape],) if shape in GEMM_WG_PEND_TWO_PER_SM else ())


def gemm_wg_variant(dtype: str, token_blocks: int, tiles: int, depth: int, aligned: bool,
                    pend: int | None = None, ksplit: int = 1) -> str:
    """The kernel's name; ``pend`` other than the default PEND of the token tile names that template argument,
    ``ksplit`` = 2 (two K streams per CTA, template argument KW) names both."""
    default = gemm_wg_pend(token_blocks)
    if ksplit != 1:
        extra = f", {default if pend is None else pend}, {ksplit}"
    else:
        extra = "" if pend is None or pend == default else f", {pend}"
    return (f"awq_gemm_wg_kernel<{CTYPE[dtype]}, {token_blocks}, {tiles}, {depth}, "
            f"{'true' if aligned else 'false'}{extra}>")


def gemm_wg_smem_bytes(token_blocks: int) -> int:
    """Dynamic shared memory of awq_gemm_wg_kernel: GEMM_WG_SLOTS x slots of 8 NB rows x 128 B, plus 1 KB to
    align them."""
    return GEMM_WG_SLOTS * 8 * token_blocks * 128 + 1024


def tile_x_variant(dtype: str) -> str:
    return f"awq_tile_x_kernel<{CTYPE[dtype]}>"


# Two K streams per CTA (KW = 2, kernels_cu/gemm_wg.cu): the default shapes of the token tiles on which
# plans.wgmma_ksplit takes them (128 and 256 tokens).
GEMM_WG_KSPLIT_SHAPES = tuple(s for t, s in GEMM_WG_DEFAULT.items() if t >= 128)

GEMM_WG = KernelFamily("gemm_wg", "gemm_wg.cu",
                       lambda arch: tuple(gemm_wg_variant(d, *s, ga, pend) for d in gemm_dtypes(arch)
                                          for s in GEMM_WG_SHAPES for ga in (True, False)
                                          for pend in gemm_wg_pends(s))
                       + tuple(gemm_wg_variant(d, *s, ga, ksplit=2) for d in gemm_dtypes(arch)
                               for s in GEMM_WG_KSPLIT_SHAPES for ga in (True, False))
                       + tuple(tile_x_variant(d) for d in gemm_dtypes(arch)),
                       hot=True, min_cc=90, arch_specific=True)

BENCH_UTIL = KernelFamily("bench_util", "bench_util.cu",
                          lambda arch: ("awq_spin_kernel", "awq_touch_kernel", "awq_stream_probe_kernel",
                                        "awq_empty_kernel")
                          + tuple(f"awq_{k}_kernel<{n}>" for k, ns in (("ldg_probe", (4, 8, 16)),
                                                                       ("mma_probe", (4, 8, 16)),
                                                                       ("read_pdl", (4, 8)),
                                                                       ("code_probe", (16, 64, 256, 1024)))
                                  for n in ns),
                          hot=False)

# sm_90a probes for bench/ (kernels_cu/bench_wg.cu): wgmma rates by N and accumulators per warpgroup
BENCH_WG = KernelFamily("bench_wg", "bench_wg.cu",
                        lambda arch: tuple(f"awq_wgmma_probe_kernel<{n}, {a}>" for n in (8, 16, 32, 64)
                                           for a in (1, 2, 4, 8) if n * a <= 128)
                        + tuple(f"awq_wgmma_sts_probe_kernel<{n}, {pw}, {d}>" for n in (64, 256)
                                for pw, d in ((0, 0), (4, 0), (8, 0), (4, 1), (8, 1), (12, 1))
                                if n == 64 or pw <= 8)
                        + tuple(f"awq_wgmma_sts_probe_kernel<256, 8, {d}, {m}>" for d in (1, 2, 3)
                                for m in ("true", "false") if d > 1 or m == "false"),
                        hot=False, min_cc=90, arch_specific=True)

# PROTOTYPE for bench/wb_probe.py (kernels_cu/gemm_wb.cu, sm_90a): the weights as the wgmma B operand, decoded by
# producer warps (bench/NOTES.md v33). Not on matmul's path; compiled here so that CI keeps it building. The script
# instantiates other template arguments itself.
GEMM_WB = KernelFamily("gemm_wb", "gemm_wb.cu",
                       lambda arch: ("awq_gemm_wb_kernel<__half, 4, 4>", "awq_gemm_wb_kernel<__half, 4, 4, true>"),
                       hot=False, min_cc=90, arch_specific=True)

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (DEQUANT, REPACK, GEMM_TC, GEMM_WG, GEMV_TC, BENCH_UTIL,
                                                         BENCH_WG, GEMM_WB)}


def dequant_variant(out_dtype: str, scale_dtype: str) -> str:
    return f"awq_dequant_gemm_kernel<{CTYPE[out_dtype]}, {CTYPE[scale_dtype]}>"


def kernel(family: str, variant: str, device_id: int | None = None):
    return get_kernel(FAMILIES[family], variant, device_id)


def compile_all(archs=None, families=None, *, log=None):
    """Compile every variant of every family for every arch (no GPU needed).

    Returns one row per (family, arch, variant): dict(family, arch, variant, registers, spill_stores,
    spill_loads, stack_frame, static_smem, hot, seconds, cached). Raises CompileError on the first failure.
    """
    from .jit import ARCHS, compile_family

    archs = list(ARCHS) if archs is None else list(archs)
    unknown = [f for f in (families or ()) if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown kernel family {unknown[0]!r}; supported: {', '.join(FAMILIES)}")
    fams = [FAMILIES[f] for f in (families or FAMILIES)]
    rows = []
    for a in archs:
        if a not in ARCHS:
            raise ValueError(f"unknown arch {a!r}; supported: {', '.join(ARCHS)}")
        arch = ARCHS[a]
        for fam in fams:
            if not fam.supports(arch):
                continue
            c = compile_family(fam, arch)
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
