"""Which kernel ``matmul`` runs for a given M, per GPU architecture: data, measured on the GPU named per row.

``gemv_max_m``: largest M for the swapped-operand tensor-core GEMV (kernels_cu/gemv_tc.cu; at most 32).
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
    # H200 (sm_90), 2026-11-29: fused GEMM loses to dequantize + cuBLAS from M = 128 on all Mistral-7B layers.
    "90": Dispatch(gemv_max_m=32, cublas_min_m=128),
    "default": Dispatch(gemv_max_m=32, cublas_min_m=128),
}


def for_arch(arch_key: str) -> Dispatch:
    return TABLE.get(arch_key, TABLE["default"])
