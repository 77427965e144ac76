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

// awq_cupy tile layout (awq_cupy/layout.py) -> dense W [K, N] in T, the exact values the tensor-core kernel
// feeds to its mma: (q - z) * s with T's own subtraction (exact) and multiplication (one rounding).
// One thread per tile word (8 codes); launched by awq_cupy.dequantize and the dequantize + cuBLAS path.
template <typename T>
__global__ void awq_dequant_tiles_kernel(
    const u32* __restrict__ qtiles,  // [NT][KT][32][4]
    const T* __restrict__ scales,    // [NG, Np] permuted
    const T* __restrict__ zeros,     // [NG, Np] permuted MAGIC + z
    T* __restrict__ out,             // [K, N]
    int K, int N, int NT, int KT, int G, int NG) {
  const long long total = (long long)NT * KT * 128;
  const int Np = NT * 64;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int j = (int)(i & 3), lane = (int)((i >> 2) & 31);
    const long long rest = i >> 7;
    const int kt = (int)(rest % KT), nt = (int)(rest / KT);
    const int r = lane & 3, c = lane >> 2;
    const u32 w = qtiles[i];
    const int k0 = 16 * kt + 2 * r;
    if (k0 >= K) continue;
    const int g = min(k0 / G, NG - 1);       // k0 .. k0 + 9 share a group (G % 32 == 0 or G == K)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 2 * j + h;                 // fragment column index: n = 64 nt + c + 8 m
      const int n = 64 * nt + c + 8 * m;
      if (n >= N) continue;
      const long long sidx = (long long)g * Np + 64 * nt + 8 * c + m;
      u32 s = *reinterpret_cast<const unsigned short*>(scales + sidx);
      u32 z = *reinterpret_cast<const unsigned short*>(zeros + sidx);
      s |= s << 16; z |= z << 16;
      const u32 lo = dequant_pair<T>(int4pair_magic<T>(w >> (8 * h)), z, s);      // k0, k0 + 1
      const u32 hi = dequant_pair<T>(int4pair_magic<T>(w >> (8 * h + 4)), z, s);  // k0 + 8, k0 + 9
      const unsigned short* lo16 = reinterpret_cast<const unsigned short*>(&lo);
      const unsigned short* hi16 = reinterpret_cast<const unsigned short*>(&hi);
      unsigned short* o = reinterpret_cast<unsigned short*>(out);
      if (k0 < K) o[(long long)k0 * N + n] = lo16[0];
      if (k0 + 1 < K) o[(long long)(k0 + 1) * N + n] = lo16[1];
      if (k0 + 8 < K) o[(long long)(k0 + 8) * N + n] = hi16[0];
      if (k0 + 9 < K) o[(long long)(k0 + 9) * N + n] = hi16[1];
    }
  }
}
