"""The kernel table: every kernel family awq_cupy compiles, and the variants it instantiates per arch.

This is the single place that lists template instantiations; ``python -m awq_cupy compile`` and the CI compile
check iterate over it, and the ops look kernels up through ``kernel(family, variant)``.
"""
from __future__ import annotations

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

# Tensor-core GEMM: m-blocks of 16 rows per CTA x pipeline depth. The stage count per arch keeps the largest
# variant inside the arch's opt-in shared memory (sm_75: 64 KB and no cp.async, so double buffering).
GEMM_MBLOCKS = (1, 2, 4)


def gemm_stages(arch: Arch) -> int:
    return 4 if arch.cc >= 80 else 2


def gemm_variant(dtype: str, mblocks: int, stages: int) -> str:
    return f"awq_gemm_tc_kernel<{CTYPE[dtype]}, {mblocks}, {stages}>"


def reduce_variant(dtype: str) -> str:
    return f"awq_splitk_reduce_kernel<{CTYPE[dtype]}>"


def _gemm_variants(arch: Arch) -> tuple[str, ...]:
    st = gemm_stages(arch)
    return tuple(gemm_variant(d, mb, st) for d in gemm_dtypes(arch) for mb in GEMM_MBLOCKS) + tuple(
        reduce_variant(d) for d in gemm_dtypes(arch))


GEMM_TC = KernelFamily("gemm_tc", "gemm_tc.cu", _gemm_variants, hot=True)

# Swapped-operand tensor-core GEMV for M <= 16 (kernels_cu/gemv_tc.cu): token blocks of 8 per mma (NB), column
# groups of TW 16-column blocks per warp unit, a per-warp shared-memory ring of D 64-k units, one or two scale
# groups per unit (GA: groups span whole 64-k blocks, or there is one group). One CTA per SM of up to 16 warps.
GEMV_TOKEN_BLOCKS = (1, 2)
GEMV_TILES = (1, 2, 4)
GEMV_SHAPES = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2))   # (token blocks, tiles) pairs instantiated
GEMV_MAX_WARPS = 16


def gemv_depth(arch: Arch, tiles: int) -> int:
    """Ring slots per warp: about 6 KB of weights in flight per warp (96 KB per SM with 16 warps) where shared
    memory allows; the H200 streams HBM at ~2 TB/s with half of that (bench/NOTES.md, v9)."""
    if arch.cc < 80:
        return 2          # no cp.async: copies are synchronous, double buffering is all that helps
    full = 1 + -(-6144 // (512 * tiles))            # 13, 7, 4 for 1, 2, 4 blocks per unit
    if arch.smem_optin >= 200 * 1024:
        return full
    return max(3, full * 2 // 3) if arch.smem_optin >= 150 * 1024 else max(2, full // 2)


def gemv_depths(arch: Arch, tiles: int) -> tuple[int, ...]:
    """Ring depths instantiated for ``tiles``: the default first, then deeper ones where shared memory allows
    (the launch plan may pick them with fewer warps; `python -m awq_cupy tune` measures the choice)."""
    d = gemv_depth(arch, tiles)
    deeper = {1: (), 2: (10,), 4: (6,)}[tiles] if arch.smem_optin >= 200 * 1024 else ()
    return (d,) + tuple(x for x in deeper if x != d)


def gemv_slot_bytes(token_blocks: int, tiles: int, aligned: bool, rows: int) -> int:
    """One ring slot: weights (tiles x 512 B), scale/zero pieces, ``rows`` x rows of 128 B (as in the kernel)."""
    return tiles * 512 + (1 if aligned else 2) * tiles * 64 + rows * 128


def gemv_smem_bytes(warps: int, depth: int, token_blocks: int, tiles: int, aligned: bool, rows: int) -> int:
    """Dynamic shared memory of awq_gemv_tc_kernel: zero row + first-segment fp32 partials + the warps' rings."""
    return (16 + warps * 32 * tiles * token_blocks * 4 * 4
            + warps * depth * gemv_slot_bytes(token_blocks, tiles, aligned, rows))


def gemv_variant(dtype: str, token_blocks: int, tiles: int, depth: int, aligned: bool) -> str:
    return (f"awq_gemv_tc_kernel<{CTYPE[dtype]}, {token_blocks}, {tiles}, {depth}, "
            f"{'true' if aligned else 'false'}>")


GEMV_TC = KernelFamily("gemv_tc", "gemv_tc.cu",
                       lambda arch: tuple(gemv_variant(d, nb, tw, depth, ga) for d in gemm_dtypes(arch)
                                          for nb, tw in GEMV_SHAPES for depth in gemv_depths(arch, tw)
                                          for ga in (True, False)),
                       hot=True)

BENCH_UTIL = KernelFamily("bench_util", "bench_util.cu", lambda arch: ("awq_spin_kernel", "awq_touch_kernel", "awq_stream_probe_kernel",
                                                              "awq_ldg_probe_kernel<4>", "awq_ldg_probe_kernel<8>",
                                                              "awq_ldg_probe_kernel<16>"),
                         hot=False)

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (DEQUANT, REPACK, GEMM_TC, GEMV_TC, BENCH_UTIL)}


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
