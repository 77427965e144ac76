"""Which kernel ``matmul`` runs for a given M, per GPU architecture: data, measured on the GPU named per row.

``gemv_max_m``: largest M for the swapped-operand tensor-core GEMV (kernels_cu/gemv_tc.cu; at most 16).
``cublas_min_m``: smallest M at which dequantize + cuBLAS (fp16 only) beats the fused GEMM; it is never used
while the current stream is capturing a CUDA graph (CuPy cannot capture cuBLAS), nor with ``batch_invariant``.
Measured with ``python -m awq_cupy bench`` (see bench/NOTES.md); archs without a row use ``default``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dispatch:
    gemv_max_m: int
    cublas_min_m: int


TABLE: dict[str, Dispatch] = {
    # H200 (sm_90), 2026-11-29, Mistral-7B layers summed (bench/NOTES.md, runs v1 and v8): the GEMV beats the
    # fused GEMM up to M = 8 but not at M = 16 (136 vs 108 us); the fused GEMM beats dequantize + cuBLAS at
    # M = 128 (323 vs 349 us) and loses at M = 256 (580 vs 350 us).
    "90": Dispatch(gemv_max_m=16, cublas_min_m=256),
    "default": Dispatch(gemv_max_m=16, cublas_min_m=256),
}


def for_arch(arch_key: str) -> Dispatch:
    return TABLE.get(arch_key, TABLE["default"])
