// gemv_tc.cu: W4A16 matmul for few rows (M <= 8 NB tokens) on tensor cores, A and B swapped:
//   y^T[N, M] = W^T[N, K] @ x^T[K, M],   fp32 accumulation, one final rounding, deterministic.
//
// Why swapped: with few tokens the 16-row A operand of mma.m16n8k16 would be mostly padding. Taking the weights
// as A (16 output channels per mma) and x^T as B (8 tokens per mma) halves the tensor-core work at M <= 8. The
// tile layout (awq_cupy/layout.py) serves both roles: lane (r, c)'s word i of block (t, ks), converted as
// (w, w >> 8, w >> 4, w >> 12), is the A fragment {a0, a1, a2, a3} of channels 16t + c (rows g) and
// 16t + c + 8 (rows g + 8) at k 64ks + 16i + (2r, 2r+1), (2r+8, 2r+9).
//
// Operands: x T [M, K] (16-byte aligned rows, K % 8 == 0); qtiles uint4 [NT16][KS][32]; scales/zeros [NG, Np]
// of T, permuted per 16-column block (word c of block t holds channels 16t + c and 16t + c + 8; a block's 16
// values are two 16-byte pieces, read here as uint4); bias T [N] or null; y T [M, N].
//
// Work split, chosen so that no two CTAs share an output (no atomics, no workspace, no second kernel):
// - Column groups of TW blocks (16 TW channels) are dealt to the CTAs in contiguous, balanced ranges (one CTA
//   per SM; the largest CTA has at most one group more than the smallest).
// - Inside a CTA, the (group, 64-k block) units, group-major, are cut into W equal contiguous runs, one per warp.
//   In the layout a run is one linear byte range (a block's K is contiguous), so every warp streams the same
//   number of bytes whatever the shape.
// - A column group covered by one warp is written by that warp. A group shared by consecutive warps (at most
//   the ends of each run) leaves fp32 partials in shared memory; after one block barrier, the warp in which
//   the group starts adds them in warp order and writes y. The summation order depends on (K, N) and the GPU,
//   never on M or timing, so results are bitwise reproducible and each row is independent of the others.
// Memory pipeline: each warp owns a D-deep ring of 64-k units in shared memory. Per unit, lane l cp.asyncs its
// 16-byte word of each of the TW blocks, lanes 0 .. 4 TW SZ - 1 one 16-byte piece of the blocks' scales and
// zeros (one group per unit when groups span whole 64-k blocks, GA; else two, one per 32 k), and lanes the x
// rows of the unit's 64 k (R = min(M, 8 NB) rows of 128 bytes, XOR-swizzled for ldmatrix; rows of tokens >= M
// read a zero row). All source addresses are running pointers: no multiplications in the loop.
// No block barrier in the main loop: a lane reads back its own weight copy after cp.async.wait_group, and
// __syncwarp publishes the shared rows to the warp.
// Math: the weights enter the mma as exact (q - z) (lop3 magic conversion minus MAGIC + z); each group's fp32
// sum is multiplied by the channel's scale at the group's end (in fp32, once per 64 or 32 k).
// Variants: T x (NB, TW) x GA, with the ring depth D per (arch, TW) (table: awq_cupy/kernels.py); when M's x
// rows make the rings too large for shared memory the launch uses fewer warps. Launched by awq_cupy.matmul.
#include "common.cuh"

template <typename T, int NB, int TW, int D, bool GA>
__global__ void __launch_bounds__(512, 1) awq_gemv_tc_kernel(
    const T* __restrict__ x,          // [M, K] activations
    const uint4* __restrict__ qtiles, // [NT16][KS][32] weight blocks
    const uint4* __restrict__ scales, // [NG, Np] permuted scales, as 16-byte pieces
    const uint4* __restrict__ zeros,  // [NG, Np] permuted MAGIC + z, as 16-byte pieces
    const T* __restrict__ bias,       // [N] or nullptr
    T* __restrict__ y,                // [M, N]
    int M, int N, int K,              // problem size (M <= 8 NB)
    int NT16, int KS,                 // 16-column blocks, 64-k blocks per column block
    int G, int NG, int Np,            // group size, number of groups, padded N
    int slot_bytes) {                 // bytes per ring slot (depends on R = min(M, 8 NB))
  constexpr int SZ = GA ? 1 : 2;      // scale groups per unit
  constexpr int PV = TW * NB * 4;     // fp32 accumulators per lane
  constexpr int XP = 2 * NB;          // x pieces (16 B) a lane may copy per unit: 8 R <= 64 NB pieces
  constexpr int SZ_OFF = TW * 512;    // slot: TW x 32 uint4 weights | SZ x (TW x 32 B scales, TW x 32 B zeros) | x
  constexpr int X_OFF = SZ_OFF + SZ * TW * 64;
  extern __shared__ __align__(16) unsigned char smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int R = min(M, 8 * NB);

  // This CTA's 16-column blocks [b0, b0 + nblk), taken TW at a time ("column groups"; the last may be short),
  // and this warp's units [u0, u1) of (column group, 64-k block), relative to the CTA.
  const int b0 = (int)((long long)blockIdx.x * NT16 / gridDim.x);
  const int nblk = (int)((long long)(blockIdx.x + 1) * NT16 / gridDim.x) - b0;
  const int units = (nblk + TW - 1) / TW * KS;
  const int U = (units + W - 1) / W;
  const int u0 = min(units, warp * U), u1 = min(units, u0 + U);
  const int run = u1 - u0;

  // Shared memory: a 16-byte zero row | first-segment partials [W][32][PV] fp32 | W rings of D slots. A warp's
  // last-segment partial goes to the start of its own ring once its loop is done (slot >= 32 PV floats).
  const uint4* zero16 = reinterpret_cast<const uint4*>(smem);
  float* first_partials = reinterpret_cast<float*>(smem + 16);
  unsigned char* const rings = smem + 16 + W * 32 * PV * 4;
  unsigned char* ring = rings + warp * D * slot_bytes;
  auto partial_ptr = [&](int w2, bool first) {
    return reinterpret_cast<float4*>(first ? first_partials + (long long)w2 * 32 * PV
                                           : reinterpret_cast<float*>(rings + (long long)w2 * D * slot_bytes)) + lane * (PV / 4);
  };
  if (threadIdx.x == 0) *reinterpret_cast<uint4*>(smem) = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();

  // ---- issue cursor: the unit u0 + (issued so far), as running pointers (no divisions in the loop) ---------
  int i_left = run;
  int i_cg = u0 / KS, i_ks = u0 % KS;                     // column group (relative), 64-k block
  int i_nv = min(TW, nblk - TW * i_cg);                   // valid blocks in the column group
  int i_gk = NG == 1 ? 64 * i_ks : (64 * i_ks) % G;      // k offset of the unit inside its group
  const int g_first = NG == 1 ? 0 : 64 * i_ks / G;
  const uint4* i_w = qtiles + ((long long)(b0 + TW * i_cg) * KS + i_ks) * 32 + lane;
  // Scale/zero pieces: lane l < 4 TW SZ copies piece p = l % (4 TW) of group half h = l / (4 TW): pieces
  // 0 .. 2TW-1 are the blocks' scales, the rest their zeros (two 16-byte pieces per block and array).
  const int np8 = Np >> 3;                                // 16-byte pieces per group row
  const bool sz_lane = lane < 4 * TW * SZ;
  const int sz_p = lane % (4 * TW), sz_h = lane / (4 * TW), sz_blk = (sz_p % (2 * TW)) >> 1;
  const uint4* sz_base = (sz_p < 2 * TW ? scales : zeros) + sz_p % (2 * TW);
  const uint4* i_sz = sz_base + (long long)g_first * np8 + 2 * (b0 + TW * i_cg);
  const T* i_x[XP];
  int xdst[XP];
  bool xrow[XP];
  const int xc = lane & 7;                                // the 16-byte piece (8 k) a lane copies
#pragma unroll
  for (int j = 0; j < XP; ++j) {
    const int row = (lane >> 3) + 4 * j;
    xrow[j] = row < R;
    i_x[j] = x + (long long)(xrow[j] ? row : 0) * K + 64 * i_ks + 8 * xc;
    xdst[j] = X_OFF + row * 128 + 16 * (xc ^ (row & 7));
  }
  int i_k = 64 * i_ks;                                    // first k of the unit
  unsigned char* i_slot = ring;                           // the slot the next issue fills
  unsigned char* const ring_end = ring + D * slot_bytes;
  auto issue = [&]() {
    unsigned char* sb = i_slot;
    i_slot = i_slot + slot_bytes == ring_end ? ring : i_slot + slot_bytes;
    if (i_left > 0) {
      // Blocks past the CTA's range (a short last column group) are zero-filled, never read from memory.
#pragma unroll
      for (int i = 0; i < TW; ++i)
        cp_async16(sb + 16 * (32 * i + lane), i < i_nv ? i_w + (long long)i * KS * 32 : i_w, i < i_nv);
      if (sz_lane) {
        // the unit's second 32 k may start the next group (GA false); past K any group would do, keep this one
        const bool next = !GA && sz_h == 1 && i_gk + 32 >= G && i_k + 32 < K;
        cp_async16(sb + SZ_OFF + 16 * lane, next ? i_sz + np8 : i_sz, sz_blk < i_nv);
      }
#pragma unroll
      for (int j = 0; j < XP; ++j)
        if (xrow[j]) cp_async16(sb + xdst[j], i_k + 8 * xc < K ? i_x[j] : x, i_k + 8 * xc < K);
      --i_left;
      i_w += 32;
      i_k += 64;
#pragma unroll
      for (int j = 0; j < XP; ++j) i_x[j] += 64;
      i_gk += 64;
      if (i_gk >= G) { i_gk -= G; i_sz += np8; }
      if (!GA && i_gk >= G) { i_gk -= G; i_sz += np8; }
      if (++i_ks == KS) {                                 // next column group
        i_ks = 0;
        ++i_cg;
        i_nv = min(TW, nblk - TW * i_cg);
        i_gk = 0;
        i_k = 0;
        i_w += (long long)(TW - 1) * KS * 32;
        i_sz = sz_base + 2 * (b0 + TW * i_cg);
#pragma unroll
        for (int j = 0; j < XP; ++j) i_x[j] -= 64 * KS;
      }
    }
    cp_async_commit();
  };

  float acc[TW][NB][4], accg[TW][NB][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][nb][e] = 0.f;
  };
  // Accumulator e of (i, nb) is channel 16 (b0 + TW cg + i) + g8 + 8 (e >> 1), token 8 nb + 2 t4 + (e & 1).
  auto store = [&](int cg, const float (&v)[TW][NB][4]) {
#pragma unroll
    for (int i = 0; i < TW; ++i) {
      if (TW * cg + i >= nblk) continue;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ch = 16 * (b0 + TW * cg + i) + g8 + 8 * (e >> 1), tok = 8 * nb + 2 * t4 + (e & 1);
          if (tok < M && ch < N) {
            float r = v[i][nb][e];
            if (bias != nullptr) r += Traits<T>::to_float(bias[ch]);
            y[(long long)tok * N + ch] = Traits<T>::from_float(r);
          }
        }
    }
  };
  auto to_partials = [&](bool first) {
    float4* p = partial_ptr(warp, first);
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        p[i * NB + nb] = make_float4(acc[i][nb][0], acc[i][nb][1], acc[i][nb][2], acc[i][nb][3]);
  };

  // ldmatrix row addresses: lanes 8q..8q+7 give the rows (tokens 8 nb + lane % 8) of matrix q, i.e. piece
  // 4 p + q of the unit for the k16 steps 2p, 2p + 1.
  int xrd[NB];
  bool xrd_ok[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int tok = 8 * nb + (lane & 7);
    xrd_ok[nb] = tok < R;
    xrd[nb] = X_OFF + tok * 128;
  }
  const int xq = lane >> 3, xsw = lane & 7;        // matrix index, swizzle key (tok & 7 == lane & 7)

  zero_acc();
#pragma unroll
  for (int s = 0; s < D - 1; ++s) issue();

  int c_ks = u0 % KS, c_cg = u0 / KS;              // relative column group being consumed
  bool seg_first = true, seg_whole_start = c_ks == 0, last_partial = false;
  // GA: units left in the current scale group (its fp32 sums are scaled once, at the group's end).
  const int upg = NG == 1 ? KS : G / 64;
  int g_left = NG == 1 ? KS - c_ks : upg - c_ks % upg;
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) accg[i][nb][e] = 0.f;
  const unsigned char* c_slot = ring;
  for (int it = 0; it < run; ++it) {
    cp_async_wait<D - 2>();
    __syncwarp();
    const unsigned char* sb = c_slot;
    c_slot = c_slot + slot_bytes == ring_end ? ring : c_slot + slot_bytes;
    issue();                                       // refills the slot consumed in the previous iteration

    uint4 wv[TW];
#pragma unroll
    for (int i = 0; i < TW; ++i) wv[i] = lds128(sb + 16 * (32 * i + lane));
    u32 xf[2][NB][4];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        ldmatrix_x4(xf[p][nb], xrd_ok[nb] ? static_cast<const void*>(sb + xrd[nb] + 16 * ((4 * p + xq) ^ xsw))
                                          : static_cast<const void*>(zero16));
    const u32* szw = reinterpret_cast<const u32*>(sb + SZ_OFF);
    const bool seg_end = c_ks + 1 == KS || it + 1 == run;
    auto flush = [&](int h) {   // acc += s * accg per channel (scales of group half h of this unit); accg = 0
#pragma unroll
      for (int i = 0; i < TW; ++i) {
        const u32 sw = szw[16 * TW * h + 8 * i + g8];
        const T* sp = reinterpret_cast<const T*>(&sw);
        const float slo = Traits<T>::to_float(sp[0]), shi = Traits<T>::to_float(sp[1]);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[i][nb][e] = fmaf(e < 2 ? slo : shi, accg[i][nb][e], acc[i][nb][e]);
            accg[i][nb][e] = 0.f;
          }
      }
    };
#pragma unroll
    for (int h = 0; h < SZ; ++h) {
      WeightDecoder<T> dec[TW];
#pragma unroll
      for (int i = 0; i < TW; ++i) dec[i].set_zeros(szw[16 * TW * h + 8 * TW + 8 * i + g8]);
#pragma unroll
      for (int tt = 0; tt < 4 / SZ; ++tt) {
        const int t = h * (4 / SZ) + tt;           // k16 step of the unit
#pragma unroll
        for (int i = 0; i < TW; ++i) {
          u32 a[4];
          dec[i].a_fragment(t == 0 ? wv[i].x : t == 1 ? wv[i].y : t == 2 ? wv[i].z : wv[i].w, a);
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            const u32* b = xf[t >> 1][nb] + 2 * (t & 1);
            mma_16816<T>(accg[i][nb], a, b[0], b[1]);
          }
        }
      }
      if (!GA) flush(h);                           // two groups per unit: each half is its own group
    }
    if (GA) {
      if (--g_left == 0 || seg_end) flush(0);
      if (g_left == 0) g_left = upg;
    }

    // Segment (one column group inside this run) ends at the group's last unit or at the run's end.
    if (++c_ks == KS || it + 1 == run) {
      if (seg_whole_start && c_ks == KS) {
        store(c_cg, acc);
      } else if (seg_first) {
        to_partials(true);
      } else {
        last_partial = true;                       // the run's end: written to the ring after the loop
        break;
      }
      zero_acc();
      seg_first = false;
      seg_whole_start = true;
      if (c_ks == KS) { c_ks = 0; ++c_cg; }
    }
  }
  cp_async_wait<0>();                              // (only empty groups can still be pending)
  __syncwarp();                                    // every lane is done reading the ring
  if (last_partial) to_partials(false);
  __syncthreads();

  // Shared column groups: the warp in which a group starts sums the partials of its contributors in warp
  // order. Only the run's last group can start here and continue past the run's end.
  if (run > 0) {
    const int tl = (u1 - 1) / KS;
    if (tl * KS >= u0 && (tl + 1) * KS > u1) {
      const int w_hi = ((tl + 1) * KS - 1) / U;
      float v[TW][NB][4];
#pragma unroll
      for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) v[i][nb][e] = 0.f;
      for (int w2 = warp; w2 <= w_hi; ++w2) {
        const float4* p = partial_ptr(w2, w2 != warp || tl * KS == u0);
#pragma unroll
        for (int i = 0; i < TW; ++i)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            const float4 q = p[i * NB + nb];
            v[i][nb][0] += q.x; v[i][nb][1] += q.y; v[i][nb][2] += q.z; v[i][nb][3] += q.w;
          }
      }
      store(tl, v);
    }
  }
}
