// gemm_wg.cu: W4A16 matmul on Hopper warpgroup MMA (sm_90a), y^T[N, M] = W^T @ x^T, fp32 accumulation.
// For M from a few dozen rows up (the dispatch table's wgmma_min_m); the sm_90a counterpart of awq_gemm_sw_kernel
// (gemm_tc.cu), with the same operands, work split and weight rounding (fp32 sums may differ in the last bits).
//
// Why: mma.sync stays below ~45% of the tensor pipe here (bench/NOTES.md, v12): with the accumulators of a
// useful tile in registers only two warps fit per scheduler, and each warp's stream of decode + ldmatrix + mma
// stalls on its own dependencies. wgmma runs asynchronously: a warp issues one instruction per 16 channels x
// 8 NB tokens x 16 k and decodes the next weight fragments while the tensor cores work.
// - A (the weights) comes from registers: each warp's 16 channels of a 16-column block, decoded from the tile
//   layout exactly as in the GEMV / v12 (the word of lane (g, t) is its mma A fragment), times the scales:
//   T((q - z) * s) with one rounding. A warpgroup's 4 warps make the 64 rows of one wgmma.
// - B (x^T) comes from shared memory: per 64-k unit BM = 8 NB token rows of 128 bytes, 16-byte chunks XOR-swizzled
//   by row (the 128-byte swizzle of the wgmma descriptor, slots 1024-byte aligned); k16 step t starts 32 t bytes in.
// Pipeline: weights, scales and x chunks of unit u + P - 1 are loaded into registers while unit u runs (no
// cp.async: it does not overlap on the H200, v10); after unit u a thread stores its x chunks of unit u + 1 into
// one of three slots, fences them for the async proxy and the CTA meets at one barrier. Per k16 step a warp
// waits until at most one wgmma group is pending (so the fragment buffer it is about to overwrite, used two steps
// ago, is free, and every slot but the last two is no longer read), decodes, fences and issues TW wgmma.
// Work split: CTA = 8 warps (2 warpgroups) x TW 16-column blocks per warp x BM tokens; grid (column tiles, splits,
// token tiles); split-K partials summed by awq_splitk_reduce_kernel (gemm_tc.cu) in split order.
// Variants: T x (NB, TW, P) x GA (table: awq_cupy/kernels.py GEMM_WG_SHAPES).
#include "common.cuh"
#include "gemm_units.cuh"
#include "wgmma.cuh"

namespace awq_wg {
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int SLOTS = 3;

AWQ_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
AWQ_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> AWQ_DEVICE void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy stores to shared memory become visible to wgmma (async proxy) reads.
AWQ_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving accesses of an accumulator across the asynchronous MMAs.
template <int R> AWQ_DEVICE void pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor, K-major with the 128-byte swizzle: start address / 16 (bits 0-13), leading
// byte offset 1 (unused by swizzled K-major layouts), stride byte offset 1024 / 16 between 8-row groups
// (bits 32-45), swizzle mode 1 = 128 B (bits 62-63).
AWQ_DEVICE u64 desc_sw128(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
}  // namespace awq_wg

template <typename T, int NB, int TW, int P, bool GA>
__global__ void __launch_bounds__(awq_wg::THREADS, 1) awq_gemm_wg_kernel(
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
    int units_per_split) {
  using namespace awq_wg;
  static_assert(P >= 2, "at least one unit loaded ahead");
  constexpr int BM = 8 * NB, SZ = GA ? 1 : 2, R = BM / 2;
  constexpr int SLOT_BYTES = BM * 128;
  using Stream = UnitStream<T, TW, SZ, BM, THREADS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // slots 1024-byte aligned (the swizzle pattern repeats every 8 rows of 128 B); the launch adds 1 KB
  const u32 raw0 = smem_addr(smem_raw);
  const u32 smem0 = (raw0 + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (smem0 - raw0);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.z * BM;
  const int ub = blockIdx.y * units_per_split;
  const int n = min(KS, ub + units_per_split) - ub;      // units of this split (>= 1 by the plan)
  const int blk0 = (blockIdx.x * WARPS + warp) * TW;      // this warp's first 16-column block
  // every warp of a warpgroup issues its wgmmas; blocks past NT16 load zeros and are not stored
  Stream units(x, qtiles, scales, zeros, M, K, NT16, KS, G, NG, Np, m0, ub, blk0, tid, lane);
  auto store_x = [&](const typename Stream::Stage& st, int slot) {
    units.store_x(st, smem + slot * SLOT_BYTES);
    fence_proxy_async();
  };

  float acc[TW][R];
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int e = 0; e < R; ++e) acc[i][e] = 0.f;
  u32 afr[2][TW][4];   // fragment buffers of even / odd k16 steps

  auto compute = [&](const typename Stream::Stage& st, u32 slot_addr) {
#pragma unroll
    for (int h = 0; h < SZ; ++h) {
      ScaledDecoder<T> dec[TW];
#pragma unroll
      for (int i = 0; i < TW; ++i) dec[i].set(st.z[h][i], st.s[h][i]);
#pragma unroll
      for (int tt = 0; tt < 4 / SZ; ++tt) {
        const int t = h * (4 / SZ) + tt;
        wait<1>();                                     // step t - 2 (buffer t & 1) has finished
#pragma unroll
        for (int i = 0; i < TW; ++i) dec[i].fragment(awq_units::word(st.w[i], t), afr[t & 1][i]);
        fence();
        const u64 desc = desc_sw128(slot_addr + 32 * t);
#pragma unroll
        for (int i = 0; i < TW; ++i) Wgmma<T, BM>::run(acc[i], afr[t & 1][i], desc);
        commit();
      }
    }
  };

  // Prologue: P - 1 units in registers, unit 0's x in slot 0.
  typename Stream::Stage st[P];
#pragma unroll
  for (int j = 0; j < P - 1; ++j)
    if (j < n) units.load(st[j]);
  store_x(st[0], 0);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < TW; ++i) pin(acc[i]);

  int slot = 0;
  for (int it = 0; it < n; it += P) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int u = it + j;
      if (u >= n) break;
      if (u + P - 1 < n) units.load(st[(j + P - 1) % P]);
      compute(st[j], smem0 + slot * SLOT_BYTES);
      slot = slot == SLOTS - 1 ? 0 : slot + 1;
      // slot of unit u + 1 was last read by unit u - 2, whose wgmmas every warpgroup saw finish before the
      // previous barrier (its waits at the steps of unit u - 1)
      if (u + 1 < n) store_x(st[(j + 1) % P], slot);
      __syncthreads();
    }
  }
  wait<0>();
#pragma unroll
  for (int i = 0; i < TW; ++i) pin(acc[i]);

  store_swapped_tile<T, TW, NB>([&](int i, int j, int e) { return acc[i][4 * j + e]; }, bias, y, ws, M, N, Np, m0,
                                blk0, units.nvalid, lane);
}
