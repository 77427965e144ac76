// repack.cu: AutoAWQ "gemm" qweight -> awq_cupy's tensor-core tile layout (awq_cupy/layout.py documents it).
//
//   in   qweight int32 [K, N/8]       gemm packing: column 8c + j of row k in nibble slot REV[j]
//   out  tiles   uint32 [NT16][KS][32][4], NT16 = ceil(N / 64) * 4, KS = ceil(K / 64)
// Output word (t, ks, lane, i) with r = lane % 4, c = lane / 4 holds, for v = 0..7,
//   Q[64 ks + 32 (i >> 1) + 8 r + 4 (i & 1) + 2 ((v >> 1) & 1) + (v & 1),  16 t + c + 8 (v >> 2)]
// in nibble slot REV[v], i.e. lane (r, c)'s mma.m16n8k16 A fragment of the block's 16 channels for mma k16 step
// i, in the k order of layout.k_of_kappa (each lane's x^T values of a 32-k half are 8 consecutive k). Codes
// outside K x N are 0 (the matmul masks x there).
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
      const int k = 64 * ks + layout_k(step, r) + 2 * ((v >> 1) & 1) + (v & 1);
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
