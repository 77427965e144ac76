// dequant.cu: AutoAWQ "gemm" packed int4 -> dense fp16/bf16 weight.
//
//   W[k, n] = (Q[k, n] - Z[k / G, n]) * S[k / G, n]      computed in fp32, rounded once to OutT.
//
// (q - z) is an integer in [-15, 15] and S has at most 11 significant bits, so the fp32 product is exact and
// the result is bit-identical to numpy's fp16(float32(q - z) * float32(s)) (docs/formats.md §Dequantization);
// the GPU test checks that bit for bit. Operands:
//   qweight int32 [K, N/8]   gemm packing (nibble slot REV[j] holds column 8c+j)
//   qzeros  int32 [K/G, N/8] same packing
//   scales  ScaleT [K/G, N]  fp16 (as checkpoints store it) or bf16
//   out     OutT [K, N]      row-major, 16-byte aligned rows (N % 8 == 0)
// Variants: OutT x ScaleT in {__half, __nv_bfloat16}^2 (table: awq_cupy/kernels.py).
// Launched by awq_cupy.ops.dequantize_gemm. One thread per packed word (8 outputs, one 16-byte store);
// grid-stride so any K*N/8 fits the grid.
#include "awq_cupy.cuh"   // the tile kernel reads the layout through its public accessors

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

// awq_cupy tile layout (awq_cupy/layout.py) -> dense W [K, N] in T, the exact values the tensor-core GEMM
// feeds to its mma: (q - z) * s with T's own subtraction (exact) and multiplication (one rounding).
// One warp per 64(k) x 64(n) block (four 16-column blocks of the layout): each lane converts its four 16-byte
// words (128 values) into a shared-memory tile, then the warp writes the block's 64 rows as 128-byte coalesced
// segments (16-byte stores; N % 8 == 0 keeps them aligned; columns >= N and rows >= K are not written).
// Word i of lane (r, c) holds k rows 32 (i >> 1) + 8 r + 4 (i & 1) + 0..3 (layout.k_of_kappa): the four lanes of
// a row group write rows 8 apart, so the tile's 16-byte chunks are XOR-swizzled by (row / 8) % 8 to keep their
// stores in different banks.
// Grid-stride over blocks; 4 warps per CTA. Launched by awq_cupy.dequantize and the dequantize + cuBLAS path
// of awq_cupy.matmul.
template <typename T>
__global__ void __launch_bounds__(128) awq_dequant_tiles_kernel(
    const uint4* __restrict__ qtiles,  // [NT16][KS][32] (one 16-byte word per lane = 4 k16 steps)
    const T* __restrict__ scales,      // [NG, Np] permuted
    const T* __restrict__ zeros,       // [NG, Np] permuted MAGIC + z
    T* __restrict__ out,               // [K, N]
    int K, int N, int NT, int KS, int G, int NG) {
  __shared__ __align__(16) unsigned short tile[4][64][64 + 8];   // +8: rows 144 B apart, fewer bank conflicts
  auto col_at = [](int row, int col) { return (((col >> 3) ^ ((row >> 3) & 7)) << 3) | (col & 7); };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane & 3, c = lane >> 2;
  const int Np = NT * 64;
  const long long nblocks = (long long)NT * KS;
  for (long long b = (long long)blockIdx.x * 4 + warp; b < nblocks; b += (long long)gridDim.x * 4) {
    const int ks = (int)(b % KS), nt = (int)(b / KS);
    if (64 * ks >= K) continue;                                   // K padding: nothing to write
    const u32* sp[4];
    const u32* zp[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {                                 // word i lies in the 32-k half i / 2: one group
      const long long off = awq_group_offset(Np, awq_group(64 * ks + 32 * (i >> 1), G, NG), 4 * nt) + 2 * c;
      sp[i] = reinterpret_cast<const u32*>(scales + off);
      zp[i] = reinterpret_cast<const u32*>(zeros + off);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {                                 // 16-column block 4 nt + j
      const uint4 wv = awq_load_tile(qtiles, KS, 4 * nt + j, ks, lane);
      const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 w = words[i];
        const u32 sw = __ldg(sp[i] + 8 * j), zw = __ldg(zp[i] + 8 * j);   // low: column c, high: column c + 8
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 s2 = h ? bcast_hi(sw) : bcast_lo(sw);
          const u32 z2 = h ? bcast_hi(zw) : bcast_lo(zw);
          const u32 lo = dequant_pair<T>(int4pair_magic<T>(w >> (8 * h)), z2, s2);      // pair f = 0
          const u32 hi = dequant_pair<T>(int4pair_magic<T>(w >> (8 * h + 4)), z2, s2);  // pair f = 1
          const int row = awq_tile_k(i, r), col = col_at(row, 16 * j + 8 * h + c);
          tile[warp][row][col] = (unsigned short)(lo & 0xFFFF);
          tile[warp][row + 1][col] = (unsigned short)(lo >> 16);
          tile[warp][row + 2][col] = (unsigned short)(hi & 0xFFFF);
          tile[warp][row + 3][col] = (unsigned short)(hi >> 16);
        }
      }
    }
    __syncwarp();
    // 64 rows x 8 chunks of 16 bytes: 16 per lane, lanes 8q..8q+7 cover one 128-byte row.
#pragma unroll 4
    for (int it = 0; it < 16; ++it) {
      const int row = 4 * it + (lane >> 3), chunk = lane & 7;
      const int k = 64 * ks + row, n = nt * 64 + 8 * chunk;
      if (k < K && n < N)
        *reinterpret_cast<uint4*>(out + (long long)k * N + n) =
            *reinterpret_cast<const uint4*>(&tile[warp][row][col_at(row, 8 * chunk)]);
    }
    __syncwarp();
  }
}
