// gemm_tc.cu: fused W4A16 matmul on tensor cores, y[M, N] = x[M, K] @ W[K, N] (+ bias), fp32 accumulation.
//
// Operands (prepared once by awq_cupy.weight.QuantizedWeight; layout documented in awq_cupy/layout.py):
//   x       T [M, K] row-major, K % 8 == 0, 16-byte aligned rows           (T = __half or __nv_bfloat16)
//   qtiles  uint4 [NT16][KS][32]: W's int4 codes in 64(k) x 16(n) blocks, one 16-byte word per lane whose
//           word i holds exactly the lane's mma.m16n8k16 B fragments of k16 step i (Marlin's fragment order).
//           NT16 = Np / 16 = 4 NT, KS = Kp / 64 = KT / 4 with Np, Kp = N, K rounded up to 64. Padded codes
//           are 0 and meet x = 0 (masked).
//   scales  T [NG, Np]: per 16-column block permuted so that position 2c + h holds column c + 8h, i.e. lane
//           c = lane / 4 finds the two fragment columns of a block in one 32-bit word.
//   zeros   T [NG, Np]: same permutation, stored as MAGIC + z (1024 + z for fp16, 128 + z for bf16), so the
//           lop3 output minus the zero is exactly q - z.
//   bias    T [N] or null; y T [M, N]; ws float [splits, M, Np] partial sums when splits > 1.
//
// Work split: CTA = 4 warps, each owning one 64-column n-tile for all BM = 16 * MB rows of its m-block and
// the CTA's k-range; the grid is (ceil(NT / 4), splits, ceil(M / BM)). Split-K CTAs write fp32 partials that
// awq_splitk_reduce_kernel sums in a fixed order (deterministic, one final rounding).
// Pipeline: STAGES-deep cp.async ring of 64-k stages holding the x tile (XOR-swizzled for ldmatrix), the
// four warps' weight blocks (2 KB per warp, evict-first: weights are read once) and up to two groups of
// scales/zeros (a 64-k stage spans at most two groups when G % 32 == 0, or one group when G == K).
// Per stage a warp reads its four 16-column blocks (four 16-byte words per lane, one word per k16 step each);
// per k16 step it ldmatrix.x4's its A fragments per m-block, converts one word per block into 16 B fragment
// registers (4 lop3 + 4 shifts + 8 sub + 8 mul), then issues 8 * MB mma.
// Variants: T in {fp16, bf16 (sm_80+)}, MB in {1, 2, 4}, STAGES per arch (table: awq_cupy/kernels.py).
// Launched by awq_cupy.matmul (awq_cupy/ops.py).
#include "common.cuh"

namespace awq_tc {
constexpr int BK = 64;                 // k per pipeline stage
constexpr int WARPS = 4;               // warps per CTA, one 64-column n-tile each
constexpr int THREADS = 32 * WARPS;
constexpr int BN = 64 * WARPS;         // CTA columns
constexpr int KSTEPS = BK / 16;        // k16 steps per stage

// Shared memory per stage (bytes): A tile, weight tiles, scales + zeros for two groups.
template <int MB> struct StageLayout {
  static constexpr int a_bytes = 16 * MB * BK * 2;
  static constexpr int b_bytes = WARPS * KSTEPS * 32 * 16;
  static constexpr int sz_bytes = 2 * 2 * BN * 2;
  static constexpr int bytes = a_bytes + b_bytes + sz_bytes;
};

// A tile rows are BK = 64 halves = 8 chunks of 16 B; chunk c of row r is stored at c ^ (r % 8) so the 8 rows
// an ldmatrix phase reads fall in 8 different bank groups.
AWQ_DEVICE int swz(int row, int chunk) { return row * (BK / 8) + (chunk ^ (row & 7)); }
}  // namespace awq_tc

template <typename T, int MB, int STAGES>
__global__ void __launch_bounds__(awq_tc::THREADS) awq_gemm_tc_kernel(
    const T* __restrict__ x,         // [M, K] activations
    const uint4* __restrict__ qtiles,// [NT16][KS][32] weight blocks
    const T* __restrict__ scales,    // [NG, Np] permuted scales
    const T* __restrict__ zeros,     // [NG, Np] permuted MAGIC + z
    const T* __restrict__ bias,      // [N] or nullptr
    T* __restrict__ y,               // [M, N] output (used when splits == 1)
    float* __restrict__ ws,          // [splits, M, Np] fp32 partials (used when splits > 1)
    int M, int N, int K,             // problem size (N % 8 == 0, K % 8 == 0)
    int NT, int KT,                  // n-tiles (Np / 64) and k16-tiles (Kp / 16)
    int G, int NG,                   // group size and number of groups
    int stages_per_split) {          // 64-k stages per split (grid.y splits cover KT / 4 stages)
  using namespace awq_tc;
  using L = StageLayout<MB>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nt = blockIdx.x * WARPS + warp;           // this warp's n-tile
  const bool warp_active = nt < NT;
  const int split = blockIdx.y, splits = gridDim.y;
  const int m0 = blockIdx.z * 16 * MB;
  const int Np = NT * 64;
  const int total_stages = KT / KSTEPS;
  const int s_begin = split * stages_per_split;
  const int s_end = min(total_stages, s_begin + stages_per_split);
  const int n_stages = max(0, s_end - s_begin);
  const u64 policy = evict_first_policy();

  auto stage_ptr = [&](int slot) { return smem + slot * L::bytes; };

  // Issue the cp.async copies of k-stage `s` (absolute index) into ring slot `slot`.
  auto load_stage = [&](int s, int slot) {
    unsigned char* base = stage_ptr(slot);
    T* a = reinterpret_cast<T*>(base);
    uint4* b = reinterpret_cast<uint4*>(base + L::a_bytes);
    T* sz = reinterpret_cast<T*>(base + L::a_bytes + L::b_bytes);
    const int k0 = s * BK;
    // x tile: 16*MB rows x 8 chunks of 16 B; rows >= M and k >= K are zero-filled.
#pragma unroll
    for (int i = tid; i < 16 * MB * 8; i += THREADS) {
      const int row = i >> 3, ch = i & 7;
      const int m = m0 + row, k = k0 + ch * 8;
      const bool ok = (m < M) && (k < K);
      const T* src = ok ? x + (long long)m * K + k : x;
      cp_async16(a + swz(row, ch) * 8, src, ok);
    }
    // weight blocks: warp w copies the 4 x 512 B of its 16-column blocks 4 nt + j at k-block k0 / 64 (lane l
    // moves bytes [16 l, 16 l + 16) of each).
    {
      const int t_nt = blockIdx.x * WARPS + warp;
      const bool ok = t_nt < NT;
      const int KS = KT / KSTEPS;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4* src = ok ? qtiles + ((long long)(4 * t_nt + j) * KS + (k0 >> 6)) * 32 + lane : qtiles;
        cp_async16_stream(b + (warp * 4 + j) * 32 + lane, src, ok, policy);
      }
    }
    // scales and zeros of the (at most two) groups this stage touches: 2 arrays x 2 groups x 32 chunks.
    {
      const int which = tid >> 6, gi = (tid >> 5) & 1, cc = tid & 31;
      const int g0 = min(k0 / G, NG - 1), g1 = min((k0 + BK - 1) / G, NG - 1);
      const int g = gi ? g1 : g0;
      const int col = blockIdx.x * BN + cc * 8;
      const bool ok = col < Np;
      const T* srcbase = which ? zeros : scales;
      const T* src = ok ? srcbase + (long long)g * Np + col : srcbase;
      cp_async16(sz + (which * 2 + gi) * BN + cc * 8, src, ok);
    }
  };

  float acc[MB][8][4];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mb][j][e] = 0.f;

  // Prologue: fill STAGES - 1 slots (empty commit groups keep the wait counts uniform).
#pragma unroll
  for (int p = 0; p < STAGES - 1; ++p) {
    if (p < n_stages) load_stage(s_begin + p, p);
    cp_async_commit();
  }

  u32 s2[8], z2[8];   // per fragment column m: (s, s) and (MAGIC + z, MAGIC + z)
  int cur_g = -1;

  for (int it = 0; it < n_stages; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // Refill the slot consumed in the previous iteration (all threads have passed the barrier above).
    {
      const int nxt = it + STAGES - 1;
      if (nxt < n_stages) load_stage(s_begin + nxt, nxt % STAGES);
      cp_async_commit();
    }
    const unsigned char* base = stage_ptr(it % STAGES);
    const T* a = reinterpret_cast<const T*>(base);
    const uint4* b = reinterpret_cast<const uint4*>(base + L::a_bytes);
    const T* sz = reinterpret_cast<const T*>(base + L::a_bytes + L::b_bytes);
    const int k0 = (s_begin + it) * BK;
    const int g0 = min(k0 / G, NG - 1);

    if (warp_active) {
      uint4 bw[4];   // block j's words for the stage's 4 k16 steps
#pragma unroll
      for (int j = 0; j < 4; ++j) bw[j] = b[(warp * 4 + j) * 32 + lane];
#pragma unroll
      for (int t = 0; t < KSTEPS; ++t) {
        const int g = min((k0 + 16 * t) / G, NG - 1);
        if (g != cur_g) {
          cur_g = g;
          const int gi = (g == g0) ? 0 : 1;
          const u32* sv = reinterpret_cast<const u32*>(sz + (0 * 2 + gi) * BN + warp * 64 + (lane >> 2) * 2);
          const u32* zv = reinterpret_cast<const u32*>(sz + (1 * 2 + gi) * BN + warp * 64 + (lane >> 2) * 2);
#pragma unroll
          for (int i = 0; i < 4; ++i) {                 // block i: word 8 i = (column c, column c + 8)
            const u32 sw = sv[8 * i], zw = zv[8 * i];
            s2[2 * i] = bcast_lo(sw); s2[2 * i + 1] = bcast_hi(sw);
            z2[2 * i] = bcast_lo(zw); z2[2 * i + 1] = bcast_hi(zw);
          }
        }
        u32 af[MB][4];
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          const int row = mb * 16 + (lane & 15);
          ldmatrix_x4(af[mb], a + swz(row, 2 * t + (lane >> 4)) * 8);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 w = t == 0 ? bw[j].x : t == 1 ? bw[j].y : t == 2 ? bw[j].z : bw[j].w;
          // Slots (0,4), (1,5): k (2t, 2t+1), (2t+8, 2t+9) of column 16j + c; slots (2,6), (3,7): column +8.
          const u32 b00 = dequant_pair<T>(int4pair_magic<T>(w), z2[2 * j], s2[2 * j]);
          const u32 b01 = dequant_pair<T>(int4pair_magic<T>(w >> 4), z2[2 * j], s2[2 * j]);
          const u32 b10 = dequant_pair<T>(int4pair_magic<T>(w >> 8), z2[2 * j + 1], s2[2 * j + 1]);
          const u32 b11 = dequant_pair<T>(int4pair_magic<T>(w >> 12), z2[2 * j + 1], s2[2 * j + 1]);
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            mma_16816<T>(acc[mb][2 * j], af[mb], b00, b01);
            mma_16816<T>(acc[mb][2 * j + 1], af[mb], b10, b11);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  if (!warp_active) return;
  // Epilogue: c fragment (row g | g + 8, columns 2t, 2t + 1) of n8 block j -> column nt*64 + 8j + 2t.
  const int gr = lane >> 2, tc = (lane & 3) * 2;
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = nt * 64 + 8 * j + tc;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + mb * 16 + gr + 8 * h;
        if (row >= M) continue;
        float v0 = acc[mb][j][2 * h], v1 = acc[mb][j][2 * h + 1];
        if (splits == 1) {
          if (col >= N) continue;
          if (bias != nullptr) {
            v0 += Traits<T>::to_float(bias[col]);
            v1 += Traits<T>::to_float(bias[col + 1]);
          }
          *reinterpret_cast<u32*>(y + (long long)row * N + col) = pack2<T>(v0, v1);
        } else {
          *reinterpret_cast<float2*>(ws + ((long long)split * M + row) * Np + col) = make_float2(v0, v1);
        }
      }
    }
  }
}

// y[m, n] = T(sum over splits of ws[s, m, n] (in split order) + bias[n]); two columns per thread.
template <typename T>
__global__ void awq_splitk_reduce_kernel(
    const float* __restrict__ ws,  // [splits, M, Np]
    const T* __restrict__ bias,    // [N] or nullptr
    T* __restrict__ y,             // [M, N]
    int M, int N, int Np, int splits) {
  const long long pairs = (long long)M * (N / 2);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs;
       i += (long long)gridDim.x * blockDim.x) {
    const int m = (int)(i / (N / 2));
    const int n = 2 * (int)(i - (long long)m * (N / 2));
    float v0 = 0.f, v1 = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float2 p = *reinterpret_cast<const float2*>(ws + ((long long)s * M + m) * Np + n);
      v0 += p.x;
      v1 += p.y;
    }
    if (bias != nullptr) {
      v0 += Traits<T>::to_float(bias[n]);
      v1 += Traits<T>::to_float(bias[n + 1]);
    }
    *reinterpret_cast<u32*>(y + (long long)m * N + n) = pack2<T>(v0, v1);
  }
}
