// gemm_wg.cu: W4A16 matmul on Hopper warpgroup MMA (sm_90a), y^T[N, M] = W^T @ x^T, fp32 accumulation.
// For M from a few dozen rows up (the dispatch table's wgmma_min_m); the sm_90a counterpart of awq_gemm_sw_kernel
// (gemm_tc.cu), with the same operands and weight rounding (fp32 sums may differ in the last bits).
//
// Why: mma.sync stays below ~45% of the tensor pipe here (bench/NOTES.md, v12): with the accumulators of a
// useful tile in registers only two warps fit per scheduler, and each warp's stream of decode + ldmatrix + mma
// stalls on its own dependencies. wgmma runs asynchronously: a warp issues one instruction per 16 channels x
// 8 NB tokens x 16 k and decodes the next weight fragments while the tensor cores work.
// - A (the weights) comes from registers: each warp's 16 channels of a 16-column block, decoded from the tile
//   layout exactly as in the GEMV / v12 (the word of lane (g, t) is its mma A fragment), times the scales:
//   T((q - z) * s) with one rounding. A warpgroup's 4 warps make the 64 rows of one wgmma.
// - B (x^T) comes from shared memory: per 64-k unit BM = 8 NB token rows of 128 bytes in the layout's mma k order,
//   16-byte chunks XOR-swizzled by row (the 128-byte swizzle of the wgmma descriptor, slots 1024-byte aligned);
//   k16 step t starts 32 t bytes in.
// Pipeline: x is first laid out by awq_tile_x_kernel as the exact shared-memory image of each (token tile, 64-k
// unit): BM rows of 128 B, swizzled, zero past M and K. One thread requests unit u + SLOTS - 2 with a single bulk
// copy (cp.async.bulk, completion counted in bytes on the slot's mbarrier) at the start of unit u, so up to
// SLOTS - 2 units of x are in flight without registers (v13: with x staged through registers, loads issued one
// unit ahead left the tensor pipe 64% idle on long-scoreboard stalls at M = 1024). Weights, scales and zeros of
// unit u + P - 1 are loaded into registers while unit u runs (plain loads; a cp.async ring does not overlap on the
// H200, v10). Per unit every thread waits for its slot's mbarrier phase, and the CTA meets at one barrier after
// the unit, so that the slot refilled next (that of unit u - 1) is no longer read. Per k16 step a warp waits until
// at most one wgmma group is pending (so the fragment buffer it is about to overwrite, used two steps ago, is
// free, and at the barrier after unit u every wgmma of unit u - 1 has finished), decodes, fences and issues TW
// wgmma.
// Work split: a tile = 8 warps (2 warpgroups) x TW 16-column blocks per warp x BM tokens. A 1-D grid of CTAs runs
// the tiles' 64-k units in one sequence (awq_wg::Sched: stream-K, or fixed pieces per tile for batch-invariant
// results); a CTA whose range ends a tile's units moves on to the next tile without draining its loads. A tile done
// by one CTA is written directly; a tile shared by several leaves fp32 partial sums in a workspace, and the CTA that
// arrives last (an atomic count per tile) adds them in CTA order and writes y, so results are bitwise reproducible
// and there is no separate reduce kernel.
// Variants: T x (NB, TW, P) x GA (table: awq_cupy/kernels.py GEMM_WG_SHAPES); awq_tile_x_kernel per T.
#include "common.cuh"
#include "gemm_units.cuh"
#include "wgmma.cuh"

namespace awq_wg {
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int SLOTS = 6;   // x slots: SLOTS - 2 units requested ahead
// CTAs per SM the variant is compiled for: two (<= 128 registers) for one 16-column block per warp up to 64
// tokens, and at 128 tokens with one scale group per unit, where the accumulators leave room (bench/NOTES.md
// v14: two resident CTAs beat one on those shapes); (16, 1, 4) with two groups per unit would spill.
constexpr int ctas_per_sm(int NB, int TW, bool GA) { return TW == 1 && (NB <= 8 || (NB == 16 && GA)) ? 2 : 1; }

AWQ_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
AWQ_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> AWQ_DEVICE void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
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

// Which 64-k units each CTA runs (host mirror: awq_cupy.ops.wg_schedule). Tile t is column tile t / m_tiles and
// token tile t % m_tiles (the token tiles of one column tile are neighbours, so their weights are read from DRAM
// once); its KS units are iterations t KS .. t KS + KS - 1 of one sequence of I = tiles x KS.
// - Stream-K (tp == 0): CTA c runs iterations [c L, min(I, (c + 1) L)), across tile boundaries, so every CTA
//   gets the same work whatever the tile count (no partial last wave).
// - Fixed pieces (tp > 0, batch-invariant matmul): CTA c runs piece p = c % tp of tile c / tp, units
//   [p per, min(KS, (p + 1) per)); the piece boundaries, hence the summation order, depend on K and N only.
struct Sched {
  int KS, I, L, tp, per;
  AWQ_DEVICE void range(int c, int& b, int& e) const {
    if (tp > 0) {
      const int t = c / tp, p = c - t * tp;
      b = t * KS + p * per;
      e = t * KS + min(KS, (p + 1) * per);
    } else {
      b = c * L;
      e = min(I, b + L);
    }
  }
  // the CTAs that work on tile t: c0 .. c1
  AWQ_DEVICE void contributors(int t, int& c0, int& c1) const {
    if (tp > 0) {
      c0 = t * tp;
      c1 = c0 + tp - 1;
    } else {
      c0 = t * KS / L;
      c1 = ((t + 1) * KS - 1) / L;
    }
  }
  // Workspace slot of CTA c's partial sums of tile t: one per CTA (pieces), or two (stream-K: slot 2c for the
  // tile c's range starts in, 2c + 1 for the one it ends in; the tiles between are c's alone).
  AWQ_DEVICE int slot(int c, int t) const { return tp > 0 ? c : 2 * c + (c * L >= t * KS ? 0 : 1); }
};
}  // namespace awq_wg

// x [M, K] -> xt [ceil(M / BM)][KS][BM][64]: per (token tile, 64-k unit) the shared-memory image the GEMM copies
// in one piece: row r holds x^T in the mma k order of the weight layout (layout.k_of_kappa), as 16-byte chunks
// stored at chunk c ^ (r % 8) of the row (awq_units::swz); zero for rows >= M and k >= K. Chunk 4 h + w of a row
// is word w of each of the four 8-k pieces x[32 h + 8 p .. + 7], p = 0..3 (the lanes' pairs of mma k16 step
// 2 h + (w >> 1), half w & 1). One thread per chunk gathers its four words (the eight threads of a row read the
// row's 128 bytes between them, through L1) and writes 16 bytes; a warp writes four whole rows. Grid-stride.
template <typename T>
__global__ void __launch_bounds__(256) awq_tile_x_kernel(const T* __restrict__ x, uint4* __restrict__ xt, int M,
                                                       int K, int KS, int BM, long long chunks) {
  pdl_trigger();   // the GEMM may launch and load its first weights meanwhile
  pdl_wait();      // x may come from the previous kernel
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < chunks;
       i += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(i & 7);
    const long long rest = i >> 3;
    const int r = (int)(rest % BM);
    const long long tu = rest / BM;               // token tile * KS + unit
    const int ks = (int)(tu % KS);
    const long long m = (tu / KS) * BM + r;
    const int k = 64 * ks + 32 * (c >> 2) + 2 * (c & 3);   // word c & 3 of piece p = 0 (+ 8 p); K % 8 == 0
    u32 v[4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
      v[p] = (m < M && k + 8 * p < K) ? __ldg(reinterpret_cast<const u32*>(x + m * K + k + 8 * p)) : 0u;
    xt[(tu * BM + r) * 8 + (c ^ (r & 7))] = make_uint4(v[0], v[1], v[2], v[3]);   // awq_units::swz order
  }
}

template <typename T, int NB, int TW, int P, bool GA>
__global__ void __launch_bounds__(awq_wg::THREADS, awq_wg::ctas_per_sm(NB, TW, GA)) awq_gemm_wg_kernel(
    const T* __restrict__ xt,         // [M tiles][KS][BM][64] x tiles (awq_tile_x_kernel)
    const uint4* __restrict__ qtiles, // [NT16][KS][32] weight blocks
    const u32* __restrict__ scales,   // [NG, Np] permuted scales, as u32 pairs
    const u32* __restrict__ zeros,    // [NG, Np] permuted MAGIC + z, as u32 pairs
    const T* __restrict__ bias,       // [N] or nullptr
    T* __restrict__ y,                // [M, N] output
    float* __restrict__ ws,           // fp32 partial sums of shared tiles, [Sched::slot][TILE_F4][THREADS] float4
    int* __restrict__ flags,          // [tiles] arrivals at each shared tile; zero before and after the kernel
    int M, int N, int K,              // problem size
    int NT16, int KS,                 // 16-column blocks, 64-k units per block
    int G, int NG, int Np,            // group size, number of groups, padded N
    int m_tiles, int tiles,           // token tiles, tiles (column tiles x token tiles)
    int L, int tp, int per) {         // schedule (awq_wg::Sched)
  using namespace awq_wg;
  static_assert(P >= 2, "at least one unit loaded ahead");
  constexpr int BM = 8 * NB, SZ = GA ? 1 : 2, R = BM / 2;
  constexpr int SLOT_BYTES = BM * 128;
  constexpr int TILE_F4 = TW * R / 4;   // float4 of one thread's accumulators
  using Stream = UnitStream<T, TW, SZ, BM, THREADS, false>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[SLOTS];
  __shared__ int last_arrival;
  // slots 1024-byte aligned (the swizzle pattern repeats every 8 rows of 128 B); the launch adds 1 KB
  const u32 raw0 = smem_addr(smem_raw);
  const u32 smem0 = (raw0 + 1023u) & ~1023u;
  const u32 bar0 = smem_addr(bars);

  pdl_trigger();   // the next kernel may launch now: it waits for this grid before reading y
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Sched sch{KS, tiles * KS, L, tp, per};
  int it0, it1;
  sch.range(blockIdx.x, it0, it1);
  const int n = it1 - it0;                                  // units of this CTA (>= 1 by the plan)
  // tile t: column tile t / m_tiles (this warp's first 16-column block below), token tile t % m_tiles
  auto blk_of = [&](int t) { return ((t / m_tiles) * WARPS + warp) * TW; };

  // Weights, scales and zeros, per CTA segment (its part of one tile: the loop never loads past it); every warp
  // of a warpgroup issues its wgmmas; blocks past NT16 load zeros and are not stored.
  Stream units(nullptr, qtiles, scales, zeros, M, K, NT16, KS, G, NG, Np, 0, it0 % KS, blk_of(it0 / KS), tid,
               lane);
  // Thread 0 requests the x tiles of the CTA's units in order: unit v into slot v % SLOTS, from a running source
  // (r_src: the next unit's tile, r_left units to its tile's end, r_mt its token tile). No divisions per unit:
  // thread 0's extra work delays the whole CTA at the barrier after each unit.
  const T* r_src;
  int r_left, r_mt;
  {
    const int t0 = it0 / KS;
    r_mt = t0 % m_tiles;
    r_left = KS - (it0 - t0 * KS);
    r_src = xt + ((long long)r_mt * KS + (KS - r_left)) * (BM * 64);
  }
  auto request = [&](int v) {
    const int s = v % SLOTS;
    bulk_load(smem0 + s * SLOT_BYTES, r_src, SLOT_BYTES, bar0 + 8 * s);
    r_src += BM * 64;
    if (--r_left == 0) {   // the next tile: token tile r_mt + 1, or the first of the next column tile
      r_left = KS;
      if (++r_mt == m_tiles) r_mt = 0;
      r_src = xt + (long long)r_mt * KS * (BM * 64);
    }
  };

  float acc[TW][R];
  auto clear = [&]() {
#pragma unroll
    for (int i = 0; i < TW; ++i) {
#pragma unroll
      for (int e = 0; e < R; ++e) acc[i][e] = 0.f;
      pin(acc[i]);
    }
  };
  clear();
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

  // y = acc (+ bias) for tile t
  auto store_y = [&](int t) {
    const int blk = blk_of(t), nvalid = max(0, min(TW, NT16 - blk)), m0 = (t % m_tiles) * BM;
#pragma unroll
    for (int i = 0; i < TW; ++i) {
      if (i >= nvalid) continue;
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int ch = 16 * (blk + i) + (lane >> 2) + 8 * e2;
        if (ch >= N) continue;
        const float bv = bias != nullptr ? Traits<T>::to_float(bias[ch]) : 0.f;
        int tok = m0 + 2 * (lane & 3);
        T* p = y + (long long)tok * N + ch;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1)
            if (tok + e1 < M) p[e1 * N] = Traits<T>::from_float(acc[i][4 * j + 2 * e2 + e1] + bv);
          p += 8LL * N;
          tok += 8;
        }
      }
    }
  };

  // The end of the CTA's part of tile ct (whole: all of it). A whole tile is written to y. A shared one leaves
  // its fp32 partial sums in the workspace (in register order) and counts its arrival; the last of the tile's CTAs
  // to arrive adds all of them up in CTA order (so the result does not depend on the arrival order) and writes y,
  // after its own loop, where no loads are in flight and the registers are free (at most two such tiles per CTA:
  // where its range begins and where it ends).
  int pend0 = -1, pend1 = -1;
  auto finish = [&](int ct, bool whole) {
    wait<0>();
#pragma unroll
    for (int i = 0; i < TW; ++i) pin(acc[i]);
    if (!whole) {
      float4* mine = reinterpret_cast<float4*>(ws) + (long long)sch.slot(blockIdx.x, ct) * (TILE_F4 * THREADS) + tid;
#pragma unroll
      for (int q = 0; q < TILE_F4; ++q) {
        const int i = q / (R / 4), e = 4 * (q % (R / 4));
        mine[q * THREADS] = make_float4(acc[i][e], acc[i][e + 1], acc[i][e + 2], acc[i][e + 3]);
      }
      __threadfence();
      __syncthreads();
      if (tid == 0) {
        int c0, c1;
        sch.contributors(ct, c0, c1);
        const int before = atomicAdd(flags + ct, 1);
        last_arrival = before == c1 - c0;
        if (before == c1 - c0) flags[ct] = 0;   // every contributor has arrived: ready for the next launch
      }
      __syncthreads();
      if (last_arrival) {
        if (pend0 < 0) pend0 = ct;
        else pend1 = ct;
      }
    } else {
      store_y(ct);
    }
    clear();
  };

  // The CTA's range as segments, one per tile: [sb, se) of tile t. The first P - 1 units of a segment are loaded
  // before its loop (the next segment's before the previous one's epilogue), so the unrolled loop holds no
  // epilogue code (v15 measured 10-25% slower units with it inside) and the stage of unit u is st[u % P].
  typename Stream::Stage st[P];
  auto prime = [&](int t, int ub, int ns) {
    units.seek(qtiles, NT16, ub, blk_of(t), lane);
#pragma unroll
    for (int j = 0; j < P - 1; ++j)
      if (j < ns) units.load(st[j]);
  };
  int t = it0 / KS, sb = it0, se = min(it1, (t + 1) * KS);
  // The first weights are requested before awq_tile_x_kernel has finished (programmatic dependent launch,
  // common.cuh); the x tiles, the workspace and every write only after pdl_wait(). The barriers are initialised
  // before anyone waits on them.
  prime(t, sb - t * KS, se - sb);
  pdl_wait();
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) mbar_init(bar0 + 8 * s, 1);
    mbar_init_fence();
    for (int v = 0; v < min(n, SLOTS - 2); ++v) request(v);
  }
  __syncthreads();

  int slot = 0, v0 = 0;   // x slot of the next unit; the segment's first unit, counted from it0
  u32 phase = 0;
  for (;;) {
    const int ns = se - sb;
    for (int it = 0; it < ns; it += P) {
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const int u = it + j, v = v0 + u;
        if (u >= ns) break;
        // slot of unit v + SLOTS - 2 = that of unit v - 2, whose wgmmas every warpgroup saw finish before the
        // previous barrier (its waits at the steps of unit v - 1, or the epilogue's)
        if (tid == 0 && v + SLOTS - 2 < n) request(v + SLOTS - 2);
        if (u + P - 1 < ns) units.load(st[(j + P - 1) % P]);
        mbar_wait(bar0 + 8 * slot, phase);
        compute(st[j], smem0 + slot * SLOT_BYTES);
        if (++slot == SLOTS) {
          slot = 0;
          phase ^= 1u;
        }
        __syncthreads();
      }
    }
    const int ct = t;
    const bool whole = sb == t * KS && se == (t + 1) * KS, more = se < it1;
    if (more) {   // the next tile's first weights load during this one's epilogue
      ++t;
      v0 += ns;
      sb = se;
      se = min(it1, sb + KS);
      prime(t, 0, se - sb);
    }
    finish(ct, whole);
    if (!more) break;
  }

  // The shared tiles this CTA arrived at last: acc = (0 + p_c0) + p_c0+1 + ..., then y.
#pragma unroll 1
  for (int k = 0; k < 2; ++k) {
    const int t = k == 0 ? pend0 : pend1;
    if (t < 0) break;
    __threadfence();
    int c0, c1;
    sch.contributors(t, c0, c1);
    // QC float4 per contributor at a time: the loads of a whole tile at once would not fit beside the
    // accumulators in 128 registers
    constexpr int QC = TILE_F4 <= 8 ? TILE_F4 : TILE_F4 / 2;
#pragma unroll
    for (int q0 = 0; q0 < TILE_F4; q0 += QC) {
#pragma unroll 1
      for (int c = c0; c <= c1; ++c) {
        const float4* p = reinterpret_cast<const float4*>(ws) + (long long)sch.slot(c, t) * (TILE_F4 * THREADS) +
                          q0 * THREADS + tid;
        float4 v[QC];
#pragma unroll
        for (int q = 0; q < QC; ++q) v[q] = __ldcg(p + q * THREADS);
#pragma unroll
        for (int q = 0; q < QC; ++q) {
          const int i = (q0 + q) / (R / 4), e = 4 * ((q0 + q) % (R / 4));
          acc[i][e] += v[q].x;
          acc[i][e + 1] += v[q].y;
          acc[i][e + 2] += v[q].z;
          acc[i][e + 3] += v[q].w;
        }
      }
    }
    store_y(t);
    clear();
  }
}
