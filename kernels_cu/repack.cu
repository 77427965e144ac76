// repack.cu: AutoAWQ "gemm" qweight -> awq_cupy's tensor-core tile layout (awq_cupy/layout.py documents it).
//
//   in   qweight int32 [K, N/8]       gemm packing: column 8c + j of row k in nibble slot REV[j]
//   out  tiles   uint32 [NT16][KS][32][4], NT16 = ceil(N / 64) * 4, KS = ceil(K / 64)
// Output word (t, ks, lane, i) with r = lane % 4, c = lane / 4 holds, for v = 0..7,
//   Q[64 ks + 16 i + 2r + (v & 1) + 8 ((v >> 1) & 1),  16 t + c + 8 (v >> 2)]   in nibble slot REV[v],
// i.e. for k16 step 4 ks + i the mma.m16n8k16 B fragments (b0, b1) of the block's two n8 halves for lane
// (r, c) after the lop3 conversion of (w, w >> 4) and (w >> 8, w >> 12). Codes outside K x N are 0 (the
// matmul masks x there).
// One thread per output word; launched once per layer by awq_cupy.weight.QuantizedWeight (load time only).
#include "common.cuh"

__global__ void awq_repack_gemm_to_tiles_kernel(
    const u32* __restrict__ qweight,  // [K, N/8] gemm-packed codes
    u32* __restrict__ tiles,          // [NT16][KS][32][4] output
    int K, int N, int NT16, int KS) {
  const long long total = (long long)NT16 * KS * 128;
  const int words_per_row = N >> 3;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int step = (int)(i & 3), lane = (int)((i >> 2) & 31);
    const long long rest = i >> 7;
    const int ks = (int)(rest % KS), t = (int)(rest / KS);
    const int r = lane & 3, c = lane >> 2;
    u32 word = 0;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const int k = 64 * ks + 16 * step + 2 * r + (v & 1) + 8 * ((v >> 1) & 1);
      const int n = 16 * t + c + 8 * (v >> 2);
      u32 q = 0;
      if (k < K && n < N) q = awq_gemm_nibble(__ldg(qweight + (long long)k * words_per_row + (n >> 3)), n & 7);
      // nibble slot REV[v]: the same shift rule as the gemm packing (awq_gemm_nibble)
      const int shift = ((v & 1) << 4) | ((v >> 1) << 2);
      word |= q << shift;
    }
    tiles[i] = word;
  }
}
