"""The probes' kernels (bench/probes/kernels/), compiled and loaded through awq_cupy's public runtime (awq_cupy.jit).

Each family is a ``jit.KernelFamily`` whose ``source_dir`` is bench/probes/kernels: its ``#include "common.cuh"``
and the other library headers resolve in the package's kernels_cu/, so the probes use the same device helpers
as the shipped kernels, and the disk cache works as for them. None of this is in the wheel.

    from runtime import kernel          # in a script of bench/probes (its folder is on sys.path)
    k = kernel("probes", "awq_mma_probe_kernel<8>")
    k.launch((132,), (512,), (sink, np.int32(iters)))

``python3 bench/probes/runtime.py`` compiles every probe family for every arch it supports (no GPU needed): the
check that they still build against today's headers.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from awq_cupy import jit

KERNELS = Path(__file__).resolve().parent / "kernels"


def _probes(arch) -> tuple[str, ...]:
    return (("awq_touch_kernel", "awq_stream_probe_kernel", "awq_empty_kernel")
            + tuple(f"awq_{k}_kernel<{n}>" for k, ns in (("ldg_probe", (4, 8, 16)), ("mma_probe", (4, 8, 16)),
                                                         ("read_pdl", (4, 8)), ("code_probe", (16, 64, 256, 1024)))
                    for n in ns))


def _wgmma_probes(arch) -> tuple[str, ...]:
    return (tuple(f"awq_wgmma_probe_kernel<{n}, {a}>" for n in (8, 16, 32, 64) for a in (1, 2, 4, 8) if n * a <= 128)
            + tuple(f"awq_wgmma_sts_probe_kernel<{n}, {pw}, {d}>" for n in (64, 256)
                    for pw, d in ((0, 0), (4, 0), (8, 0), (4, 1), (8, 1), (12, 1)) if n == 64 or pw <= 8)
            + tuple(f"awq_wgmma_sts_probe_kernel<256, 8, {d}, {m}>" for d in (1, 2, 3)
                    for m in ("true", "false") if d > 1 or m == "false"))


FAMILIES: dict[str, jit.KernelFamily] = {f.name: f for f in (
    # memory-pipeline, load, mma.sync-rate, launch-floor and code-size probes (every arch)
    jit.KernelFamily("probes", "probes.cu", _probes, hot=False, source_dir=str(KERNELS)),
    # wgmma rates by N and accumulators per warpgroup; wgmma beside shared-memory stores (sm_90a)
    jit.KernelFamily("wgmma_probes", "wgmma_probes.cu", _wgmma_probes, hot=False, needs=("wgmma",),
                     arch_specific=True, source_dir=str(KERNELS)),
    # the weights-as-B prototype (sm_90a); wb_probe.py instantiates other template arguments through `with_variants`
    jit.KernelFamily("gemm_wb", "gemm_wb.cu",
                     lambda arch: ("awq_gemm_wb_kernel<__half, 4, 4>", "awq_gemm_wb_kernel<__half, 4, 4, true>"),
                     hot=False, needs=("wgmma",), arch_specific=True, source_dir=str(KERNELS)),
)}


def with_variants(family: str, variants: tuple[str, ...]) -> jit.KernelFamily:
    """The probe family ``family`` instantiating ``variants`` instead of its own list."""
    return dataclasses.replace(FAMILIES[family], variants=lambda arch, v=tuple(variants): v)


def kernel(family: str | jit.KernelFamily, variant: str, device_id: int | None = None) -> jit.Kernel:
    """The loaded probe kernel ``variant`` of ``family`` (a name of FAMILIES, or a family from with_variants)."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    return jit.get_kernel(fam, variant, device_id)


def compile_all(log=print) -> int:
    """Compile every probe family for every arch it supports; returns the number of variants built."""
    n = 0
    for arch in jit.ARCHS.values():
        for fam in FAMILIES.values():
            if fam.supports(arch):
                c = jit.compile_family(fam, arch)
                n += len(c.lowered)
                log(f"{fam.name} {arch.target}: {len(c.lowered)} variants "
                    f"({'cache' if c.from_cache else f'{c.seconds:.1f}s'})")
    return n


if __name__ == "__main__":
    sys.exit(0 if compile_all() else 1)
