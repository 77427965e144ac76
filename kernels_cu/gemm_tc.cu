// gemm_tc.cu: W4A16 matmul on tensor cores with mma.sync for M from a dozen rows up (every arch; sm_90 runs the
// warpgroup-MMA version in gemm_wg.cu), y[M, N] = x[M, K] @ W[K, N] (+ bias), fp32 accumulation, plus the split-K
// reduction both use.
//
// Operands (prepared once by awq_cupy.weight.QuantizedWeight; layout documented in awq_cupy/layout.py):
//   x       T [M, K] row-major, K % 8 == 0, 16-byte aligned rows           (T = __half or __nv_bfloat16)
//   qtiles  uint4 [NT16][KS][32]: W's int4 codes in 16-column x 64-k blocks, column-block major; the 16-byte word
//           of lane (g, t) is its mma.m16n8k16 A fragment (channels c, c + 8 as rows) for the block's 4 k16 steps.
//           NT16 = Np / 16, KS = Kp / 64 with Np, Kp = N, K rounded up to 64. Padded codes are 0 and meet x = 0.
//   scales  T [NG, Np] read as u32 pairs: per 16-column block permuted so that word c holds channels c and c + 8.
//   zeros   T [NG, Np]: same permutation, stored as MAGIC + z (1024 + z for fp16, 128 + z for bf16).
//   bias    T [N] or null; y T [M, N]; ws float [splits, M, Np] partial sums when splits > 1.
// Launched by awq_cupy.matmul (awq_cupy.launch.prepare_gemm).
#include "common.cuh"
#include "gemm_units.cuh"


// y[m, n] = T(sum over splits of ws[s, m, n] (in split order) + bias[n]); C = 2, 4 or 8 columns per thread
// (N % 8 == 0: AWQ packs eight channels per word; the launch picks C from the output size). A thread requests
// the C columns of up to RS splits at once and then adds them in split order: loading one split's columns and
// adding them before the next load would make a chain of L2 round trips per thread (docs/design.md §Split-K reduce).
template <typename T, int C>
__global__ void __launch_bounds__(256) awq_splitk_reduce_kernel(
    const float* __restrict__ ws,  // [splits, M, ws_ld]: columns n0..N-1
    const T* __restrict__ bias,    // [N] or nullptr
    T* __restrict__ y,             // [M, N]
    int M, int N, int ws_ld, int splits,
    int n0) {                      // first column reduced (a multiple of 8; 0 unless the GEMM split only its tail)
  static_assert(C == 2 || C == 4 || C == 8, "2, 4 or 8 columns per thread");
  constexpr int RS = 16 / C;      // splits requested together: 64 bytes per thread
  constexpr int V = C / 2;        // float2 per split
  pdl_trigger();
  pdl_wait();   // the partials come from the GEMM launched just before
  const int nc = (N - n0) / C;
  const long long items = (long long)M * nc;
  const long long split_stride = (long long)M * ws_ld;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < items;
       i += (long long)gridDim.x * blockDim.x) {
    const int m = (int)(i / nc);
    const int c = C * (int)(i - (long long)m * nc);
    const int n = n0 + c;
    const float* src = ws + (long long)m * ws_ld + c;
    float v[C];
#pragma unroll
    for (int e = 0; e < C; ++e) v[e] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += RS) {
      float2 p[RS][V];
#pragma unroll
      for (int j = 0; j < RS; ++j)
        if (s0 + j < splits) {
          const float* q = src + (s0 + j) * split_stride;
          if constexpr (C == 2) {
            p[j][0] = __ldcs(reinterpret_cast<const float2*>(q));
          } else {
#pragma unroll
            for (int h = 0; h < V / 2; ++h) {
              const float4 f = __ldcs(reinterpret_cast<const float4*>(q) + h);
              p[j][2 * h] = make_float2(f.x, f.y);
              p[j][2 * h + 1] = make_float2(f.z, f.w);
            }
          }
        }
#pragma unroll
      for (int j = 0; j < RS; ++j)
        if (s0 + j < splits)
#pragma unroll
          for (int h = 0; h < V; ++h) {
            v[2 * h] += p[j][h].x;
            v[2 * h + 1] += p[j][h].y;
          }
    }
    if (bias != nullptr) {
#pragma unroll
      for (int e = 0; e < C; ++e) v[e] += Traits<T>::to_float(bias[n + e]);
    }
    u32 out[V];
#pragma unroll
    for (int h = 0; h < V; ++h) out[h] = pack2<T>(v[2 * h], v[2 * h + 1]);
    T* dst = y + (long long)m * N + n;
    if constexpr (C == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
    else if constexpr (C == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
    else *reinterpret_cast<u32*>(dst) = out[0];
  }
}

// ============================================================================================================
// awq_gemm_sw_kernel: y^T[N, M] = W^T @ x^T with the operands swapped (the weights are the mma's A operand,
// 16 channels per mma; x^T is B, 8 tokens per mma); no cp.async anywhere.
//
// Why: on the H200 cp.async groups do not overlap with depth (docs/design.md §mma.sync GEMM (gemm_tc)): a ring of
// 64-k stages fetched with cp.async costs about one L2 round trip per stage whatever its depth, which bounds a GEMM
// built on it. Plain loads into registers, issued units ahead, do overlap.
// - Weights take the GEMV's path: 16-byte loads into registers P - 1 units ahead; each lane's word is directly its
//   A fragments (16 channels x 64 k, layout.py); no shared memory for weights.
// - x goes through shared memory so that the 8 warps of a CTA share it: each thread loads its 16-byte chunks of
//   unit u + P - 1 into registers together with the weights, stores the chunks of unit u + 1 into the other half of
//   a two-slot buffer (natural k order, XOR-swizzled) after computing unit u, then one block barrier. In the
//   layout's mma k order (layout.k_of_kappa) a lane's B fragments of 8 tokens for the two k16 steps of a 32-k
//   half are 16 consecutive bytes of its token's row: one 16-byte shared load per token block and half.
// Work split: CTA = 8 warps x TW 16-column blocks (128 TW channels) x BM = 8 NB tokens; grid (column tiles,
// splits, token tiles). A split covers a contiguous range of 64-k units; split-K CTAs write fp32 partials that
// awq_splitk_reduce_kernel sums in split order (deterministic). A token's result never depends on NB, TW or on
// the other tokens (each mma column is its own dot product), only on the split plan.
// Math: per unit and block the fragments are T((q - z) * s) with one rounding (the same values as
// awq_cupy.dequantize), then TW x NB mma per k16 step, fp32 accumulation.
// Variants: T x (NB, TW, P) x GA (table: awq_cupy/kernels.py GEMM_SHAPES); GA: each 64-k unit lies in one group.
// ============================================================================================================
namespace awq_sw {
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
// x slot of NB token blocks: 8 NB rows x 64 k x 2 bytes; the CTA double-buffers it. The launch takes
// awq_cupy.kernels.GemmVariant.smem_bytes, checked against smem_bytes by a static_assert per variant.
template <int NB> constexpr int slot_bytes() { return 8 * NB * 64 * 2; }
template <int NB> constexpr int smem_bytes() { return 2 * slot_bytes<NB>(); }
}  // namespace awq_sw

template <typename T, int NB, int TW, int P, bool GA>
__global__ void __launch_bounds__(awq_sw::THREADS, 1) awq_gemm_sw_kernel(
    const T* __restrict__ x,          // [M, K] activations
    const uint4* __restrict__ qtiles, // [NT16][KS][32] weight blocks
    const u32* __restrict__ scales,   // [NG, Np] permuted scales, as u32 pairs
    const u32* __restrict__ zeros,    // [NG, Np] permuted MAGIC + z, as u32 pairs
    const T* __restrict__ bias,       // [N] or nullptr
    T* __restrict__ y,                // [M, N] output (used when splits == 1)
    float* __restrict__ ws,           // [splits, M, Np] fp32 partials (used when splits > 1)
    int M, int N, int K,              // problem size
    int NT16, int KS,                 // 16-column blocks, 64-k units per block
    int G, int NG, int Np,            // group size, number of groups, padded N
    int units_per_split,
    int blk_base,                     // the grid's first 16-column block (0, or a tail launch's first)
    int ws_ld) {                      // floats per row of ws (its columns start at channel 16 blk_base)
  using namespace awq_sw;
  pdl_trigger();   // the split-K reduce may launch now: it waits for this grid before reading the partials
  pdl_wait();      // x may come from the previous kernel (x and weights are loaded together here)
  static_assert(P >= 2, "at least one unit loaded ahead");
  constexpr int BM = 8 * NB, SZ = GA ? 1 : 2;
  constexpr int SLOT_BYTES = slot_bytes<NB>();
  using Stream = UnitStream<T, TW, SZ, BM, THREADS>;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.z * BM;
  const int ub = blockIdx.y * units_per_split;
  const int n = min(KS, ub + units_per_split) - ub;      // units of this split (>= 1 by the plan)
  const int blk0 = blk_base + (blockIdx.x * WARPS + warp) * TW;   // this warp's first 16-column block
  const bool active = blk0 < NT16;
  const u32 smem0 = smem_addr(smem);
  Stream units(x, qtiles, scales, zeros, M, K, NT16, KS, G, NG, Np, m0, ub, blk0, tid, lane);

  float acc[TW][NB][4];
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][nb][e] = 0.f;

  // Lane (g, t4)'s B fragments (b0, b1) of k16 steps 2 h2 and 2 h2 + 1 for token block nb are the 16 bytes
  // x[token 8 nb + g, 32 h2 + 8 t4 .. + 7] of the slot (chunk 4 h2 + t4 of row 8 nb + g; rows 8 nb + g keep
  // g's parity, so one offset per half serves every nb, + 8 rows x 128 B).
  u32 xoff[2];
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) xoff[h2] = (u32)(awq_units::swz_sw(lane >> 2, 4 * h2 + (lane & 3)) * 16);

  auto compute = [&](const typename Stream::Stage& st, u32 slot_addr) {
    ScaledDecoder<T> dec[TW];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {   // 32-k halves (a half lies in one group: SZ = 2 gives each its own)
      if (h2 == 0 || SZ == 2) {
#pragma unroll
        for (int i = 0; i < TW; ++i) dec[i].set(st.z[SZ == 2 ? h2 : 0][i], st.s[SZ == 2 ? h2 : 0][i]);
      }
      u32 a[TW][2][4];
#pragma unroll
      for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) dec[i].fragment(awq_units::word(st.w[i], 2 * h2 + s2), a[i][s2]);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint4 b = lds128(slot_addr + xoff[h2] + nb * 8 * 128);
#pragma unroll
        for (int i = 0; i < TW; ++i) {
          mma_16816<T>(acc[i][nb], a[i][0], b.x, b.y);
          mma_16816<T>(acc[i][nb], a[i][1], b.z, b.w);
        }
      }
    }
  };

  // Prologue: P - 1 units in registers, unit 0's x in slot 0.
  typename Stream::Stage st[P];
#pragma unroll
  for (int j = 0; j < P - 1; ++j)
    if (j < n) units.load(st[j]);
  units.store_x(st[0], smem);
  __syncthreads();

  for (int it = 0; it < n; it += P) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int u = it + j;
      if (u >= n) break;
      if (u + P - 1 < n) units.load(st[(j + P - 1) % P]);
      if (active) compute(st[j], smem0 + (u & 1) * SLOT_BYTES);
      if (u + 1 < n) units.store_x(st[(j + 1) % P], smem + ((u + 1) & 1) * SLOT_BYTES);   // unit u - 1's slot
      __syncthreads();
    }
  }
  if (!active) return;

  store_swapped_tile<T, TW, NB>([&](int i, int j, int e) { return acc[i][j][e]; }, bias, y, ws, M, N, ws_ld,
                                16 * blk_base, m0, blk0, units.nvalid, lane);
}
