// dequant.cu: AutoAWQ "gemm" packed int4 -> dense fp16/bf16 weight.
//
//   W[k, n] = (Q[k, n] - Z[k / G, n]) * S[k / G, n]      computed in fp32, rounded once to OutT.
//
// (q - z) is an integer in [-15, 15] and S has at most 11 significant bits, so the fp32 product is exact and
// the result is bit-identical to numpy's fp16(float32(q - z) * float32(s)) (awq-formats.md §2.3) - the GPU test
// checks that bit for bit. Operands:
//   qweight int32 [K, N/8]   gemm packing (nibble slot REV[j] holds column 8c+j)
//   qzeros  int32 [K/G, N/8] same packing
//   scales  ScaleT [K/G, N]  fp16 (as checkpoints store it) or bf16
//   out     OutT [K, N]      row-major, 16-byte aligned rows (N % 8 == 0)
// Variants: OutT x ScaleT in {__half, __nv_bfloat16}^2 (table: awq_cupy/kernels.py).
// Launched by awq_cupy.ops.dequantize_gemm. One thread per packed word (8 outputs, one 16-byte store);
// grid-stride so any K*N/8 fits the grid.
#include "common.cuh"

template <typename OutT, typename ScaleT>
__global__ void awq_dequant_gemm_kernel(
    const u32* __restrict__ qweight,    // [K, N/8]  packed Q
    const u32* __restrict__ qzeros,     // [K/G, N/8] packed Z
    const ScaleT* __restrict__ scales,  // [K/G, N]
    OutT* __restrict__ out,             // [K, N]
    int K,                              // in_features
    int N,                              // out_features, multiple of 8
    int group_size) {                   // G, divides K
  const int words_per_row = N >> 3;
  const long long total = (long long)K * words_per_row;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int k = (int)(i / words_per_row);
    const int c = (int)(i - (long long)k * words_per_row);
    const int g = k / group_size;
    const u32 w = __ldg(qweight + i);
    const u32 z = __ldg(qzeros + (long long)g * words_per_row + c);
    const ScaleT* s = scales + (long long)g * N + 8 * c;
    uint4 o;
    u32* op = reinterpret_cast<u32*>(&o);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const float a = (float)((int)awq_gemm_nibble(w, j) - (int)awq_gemm_nibble(z, j)) *
                      Traits<ScaleT>::to_float(s[j]);
      const float b = (float)((int)awq_gemm_nibble(w, j + 1) - (int)awq_gemm_nibble(z, j + 1)) *
                      Traits<ScaleT>::to_float(s[j + 1]);
      op[j >> 1] = pack2<OutT>(a, b);
    }
    *reinterpret_cast<uint4*>(out + i * 8) = o;
  }
}
