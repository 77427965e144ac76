// gemv_tc.cu: W4A16 matmul for few rows (8 NB tokens; M <= 8 is dispatched here) on tensor cores, A and B swapped:
//   y^T[N, M] = W^T[N, K] @ x^T[K, M],   fp32 accumulation, one final rounding.
//
// Why swapped: with M <= 8 the 16-row A operand of mma.m16n8k16 would be mostly padding. Taking the weights as
// A (16 output channels per mma) and x^T as B (8 tokens per mma) halves the tensor-core work at M <= 8 and
// wastes none at M = 8 (the template also covers 16 and 32 tokens). The weight tile layout (awq_cupy/layout.py) serves both roles: lane (r, c)'s
// word j, converted as (w, w >> 8, w >> 4, w >> 12), is the A fragment {a0, a1, a2, a3} of channels
// 16j + c (rows g) and 16j + c + 8 (rows g + 8) at k (2r, 2r+1), (2r+8, 2r+9).
//
// Operands: as gemm_tc.cu (x T [M, K], 16-byte aligned rows; qtiles uint4 [NT][KT][32]; scales/zeros T [NG, Np]
// permuted; bias T [N] or null; y T [M, N]); accum float [M, Np] and counters int [NT], both zero between
// launches (the last contributor of an n-tile resets them).
//
// Work split ("stripes", after Marlin's striped partitioning, at warp level): the work of the whole problem,
// NT n-tiles x C chunks (a chunk = CH k16 steps, C = ceil(K / 16 CH)), n-tile major, is cut into equal
// contiguous runs of L chunks, one per warp of a grid sized to the GPU's resident capacity, so every warp
// streams the same number of bytes whatever the shape. A run that covers a whole n-tile writes y directly;
// warps sharing an n-tile add their fp32 sums into accum (red.global.add) and the last to arrive (atomic
// counter) rounds the total once. The order of those fp32 additions is not fixed, so results may differ run to
// run by fp32 rounding (matmul(batch_invariant=True) takes the deterministic GEMM path).
// Memory pipeline: each warp owns a D-deep ring of chunks in shared memory. Per chunk every lane cp.asyncs its
// CH 16-byte weight words (plain .cg: the L2::cache_hint form raised 'illegal instruction' in a 16-token variant
// on the H200, see bench/NOTES.md) and the warp copies the chunk's x rows (8 NB tokens x 16 CH k, XOR-swizzled
// 16-byte pieces) for ldmatrix.x4. Chunks of 4 steps (2 when G = 32) divide the per-step bookkeeping (ring
// wait, issue, group check) by the chunk size. No block barrier in the main loop: a lane reads back its own
// weight copy after cp.async.wait_group, and __syncwarp publishes the x rows to the warp. Scales/zeros of the
// next (n-tile, group) are prefetched into registers one group ahead.
// SCALE_IN_ACC (NB == 1): the weights enter the mma as exact (q - z) and each group's fp32 sum is multiplied by
// the channel's scale at the group's end (16 fewer multiplies per step); otherwise (q - z) * s is formed in T.
// Variants: T x NB x CH x ring depth D per arch (table: awq_cupy/kernels.py; only NB = 1 is instantiated).
// Launched by awq_cupy.matmul.
#include "common.cuh"

namespace awq_gemv {
constexpr int KW = 8;  // warps per CTA (independent; the CTA only shares the SM's shared memory budget)
}

// Dynamic shared memory: KW * D * CH * (512 + 256 NB) bytes (weight words + x rows of every warp's ring); the
// Python side computes the same number (awq_cupy.kernels.gemv_smem_bytes).
// Two CTAs (16 warps) per SM need <= 128 registers; only sm_90 has the shared memory for two 96 KB rings.
// CH: k16 steps per loop iteration ("chunk", 2 or 4); groups must span whole chunks (G % 16 CH == 0 or G == K).
template <typename T, int NB, int CH, int D>
__global__ void __launch_bounds__(32 * awq_gemv::KW, (NB == 1 && AWQ_CUPY_CC >= 900) ? 2 : 1) awq_gemv_tc_kernel(
    const T* __restrict__ x,          // [M, K] activations
    const uint4* __restrict__ qtiles, // [NT][KT][32] weight tiles
    const T* __restrict__ scales,     // [NG, Np] permuted scales
    const T* __restrict__ zeros,      // [NG, Np] permuted MAGIC + z
    const T* __restrict__ bias,       // [N] or nullptr
    T* __restrict__ y,                // [M, N]
    float* __restrict__ accum,        // [M, Np] fp32 sums of shared n-tiles (zero between launches)
    int* __restrict__ counters,       // [NT] arrival counters (zero between launches)
    int M, int N, int K,              // problem size
    int NT, int KT,                   // n-tiles, k16 tiles per n-tile (padded)
    int G, int NG,                    // group size, number of groups
    int chunks,                       // chunks per n-tile: ceil(K / (16 CH)) (KT >= CH chunks, zero-padded)
    int L) {                          // chunks per warp
  using namespace awq_gemv;
  constexpr int TOK = 8 * NB;
  constexpr int KC = 16 * CH;                    // k per chunk
  constexpr int XC = 2 * CH;                     // 16-byte pieces per x row of a chunk
  constexpr int XR = NB * CH / 2;                // x pieces each lane copies per chunk (TOK * XC / 32)
  constexpr bool SCALE_IN_ACC = NB == 1;
  extern __shared__ __align__(16) uint4 smem4[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long gw = (long long)blockIdx.x * KW + warp;
  const int steps = chunks;                      // the run/n-tile bookkeeping below counts chunks
  const long long total = (long long)NT * steps;
  const long long u0 = gw * L, u1 = min(total, u0 + L);
  if (u0 >= u1) return;                          // no block barrier below: idle warps may leave
  const int Np = NT * 64;
  const int g8 = lane >> 2, kofs = 2 * (lane & 3);
  uint4* ring_w = smem4 + warp * D * CH * 32;                                       // [D][CH][32] uint4
  T* ring_x = reinterpret_cast<T*>(smem4 + KW * D * CH * 32) + warp * D * TOK * KC; // [D][TOK][KC]
  // x rows are XC 16-byte pieces; piece c of row t is stored at swz(t, c) so that the 8 rows an ldmatrix phase
  // reads fall in 8 different bank groups (rows of 128 B: c ^ (t % 8); rows of 64 B: c ^ ((t / 2) % 4)).
  auto swz = [](int t, int c) { return XC == 8 ? (c ^ (t & 7)) : (c ^ ((t >> 1) & 3)); };

  // Issue cursor: the chunk u0 + issued, as running pointers (no divisions or multiplies in the loop). Lane l
  // copies weight word l of the chunk's CH steps and the x pieces lane + 32 r (row (lane + 32 r) / XC).
  int i_st = (int)(u0 % steps);
  int i_left = (int)(u1 - u0);                                 // chunks still to issue
  const uint4* i_w = qtiles + ((u0 / steps) * KT + CH * i_st) * 32 + lane;
  const int xc = lane % XC;
  bool xok[XR];
  const T* i_x[XR];
  int xoff[XR];
#pragma unroll
  for (int r = 0; r < XR; ++r) {
    const int row = (lane + 32 * r) / XC;
    xok[r] = row < M;
    i_x[r] = x + (long long)(xok[r] ? row : 0) * K + KC * i_st + 8 * xc;
    xoff[r] = row * KC + 8 * swz(row, xc);
  }
  int i_k = KC * i_st + 8 * xc;                                // k of this lane's x pieces
  auto issue = [&](int slot) {
    if (i_left > 0) {
#pragma unroll
      for (int t = 0; t < CH; ++t) cp_async16(ring_w + (slot * CH + t) * 32 + lane, i_w + 32 * t, true);
#pragma unroll
      for (int r = 0; r < XR; ++r) cp_async16(ring_x + slot * (TOK * KC) + xoff[r], i_x[r], xok[r] && i_k < K);
      --i_left;
      i_w += CH * 32;
      i_k += KC;
#pragma unroll
      for (int r = 0; r < XR; ++r) i_x[r] += KC;
      if (++i_st == steps) {
        i_st = 0;
        i_w += (long long)(KT - CH * steps) * 32;
        i_k = 8 * xc;
#pragma unroll
        for (int r = 0; r < XR; ++r) i_x[r] -= KC * steps;
      }
    }
    cp_async_commit();
  };
  float acc[4][NB][4];
  float accg[SCALE_IN_ACC ? 4 : 1][NB][4];
  // Visit every accumulator element: c fragment e of (j, nb) holds channel 16j + g8 + 8(e >> 1) of the n-tile
  // and token 8nb + kofs + (e & 1).
  auto each = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(j, nb, e, 16 * j + g8 + 8 * (e >> 1), 8 * nb + kofs + (e & 1));
  };
  auto zero_acc = [&]() {
    each([&](int j, int nb, int e, int, int) {
      acc[j][nb][e] = 0.f;
      if (SCALE_IN_ACC) accg[j][nb][e] = 0.f;
    });
  };
  zero_acc();

  // Scales/zeros: current group in registers, the next (n-tile, group) prefetched.
  u32 z2[8], s2[8];
  float sf[8];
  uint4 zn, sn;
  int c_nt = (int)(u0 / steps), c_st = (int)(u0 - (long long)c_nt * steps);
  int p_nt = c_nt, p_g = min(KC * c_st / G, NG - 1);     // the (n-tile, group) zn/sn hold
  auto prefetch = [&]() {
    if (p_nt < NT) {
      const long long off = (long long)p_g * Np + p_nt * 64 + g8 * 8;
      zn = __ldg(reinterpret_cast<const uint4*>(zeros + off));
      sn = __ldg(reinterpret_cast<const uint4*>(scales + off));
    }
  };
  auto advance_prefetch = [&]() {   // the group after (p_nt, p_g) in the warp's stream
    const int next_k = (p_g + 1) * G;
    if (p_g + 1 < NG && next_k < KC * steps) ++p_g;
    else { ++p_nt; p_g = 0; }
  };
  auto take_group = [&]() {
    const u32 zw[4] = {zn.x, zn.y, zn.z, zn.w}, sw[4] = {sn.x, sn.y, sn.z, sn.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      z2[2 * i] = bcast_lo(zw[i]); z2[2 * i + 1] = bcast_hi(zw[i]);
      if (SCALE_IN_ACC) {
        const T* sp = reinterpret_cast<const T*>(&sw[i]);
        sf[2 * i] = Traits<T>::to_float(sp[0]);
        sf[2 * i + 1] = Traits<T>::to_float(sp[1]);
      } else {
        s2[2 * i] = bcast_lo(sw[i]); s2[2 * i + 1] = bcast_hi(sw[i]);
      }
    }
  };
  auto flush = [&]() {   // acc += s * accg per channel: rows g -> m = 2j, rows g + 8 -> m = 2j + 1
    if (SCALE_IN_ACC) {
      each([&](int j, int nb, int e, int, int) {
        acc[j][nb][e] = fmaf(sf[2 * j + (e >> 1)], accg[j][nb][e], acc[j][nb][e]);
        accg[j][nb][e] = 0.f;
      });
    }
  };
  // Hand the finished n-tile `nt` to y, directly or through the partials of its C contributors.
  auto emit = [&](int nt) {
    const long long first = (long long)nt * steps / L, last = ((long long)nt * steps + steps - 1) / L;
    const int ncontrib = (int)(last - first + 1);
    const int mlim = min(M, TOK);
    if (ncontrib == 1) {
      each([&](int j, int nb, int e, int ch, int tok) {
        const int n = nt * 64 + ch;
        if (tok < mlim && n < N) {
          float v = acc[j][nb][e];
          if (bias != nullptr) v += Traits<T>::to_float(bias[n]);
          y[(long long)tok * N + n] = Traits<T>::from_float(v);
        }
      });
      return;
    }
    // Shared n-tile: add this run's sums into the fp32 accumulator (fire-and-forget reductions in L2); the
    // last of the n-tile's contributors converts the total once and leaves the accumulator at zero again.
    each([&](int j, int nb, int e, int ch, int tok) {
      if (tok < mlim) atomicAdd(accum + (long long)tok * Np + nt * 64 + ch, acc[j][nb][e]);
    });
    __threadfence();
    __syncwarp();
    int is_last = 0;
    if (lane == 0) is_last = atomicAdd(counters + nt, 1) == ncontrib - 1;
    is_last = __shfl_sync(0xffffffffu, is_last, 0);
    if (!is_last) return;
    __threadfence();
#pragma unroll 4
    for (int i = lane; i < 64 * mlim; i += 32) {
      const int tok = i >> 6, ch = i & 63, n = nt * 64 + ch;
      float* a = accum + (long long)tok * Np + n;
      const float v = __ldcg(a);
      __stcg(a, 0.f);
      if (n < N) y[(long long)tok * N + n] = Traits<T>::from_float(bias != nullptr ? v + Traits<T>::to_float(bias[n]) : v);
    }
    if (lane == 0) counters[nt] = 0;   // ready for the next launch (stream-ordered)
  };

  prefetch();
#pragma unroll
  for (int i = 0; i < D - 1; ++i) issue(i);

  // Group tracking without divisions: g_left = chunks before the current group ends.
  const int g_chunks = max(1, G / KC);
  int slot = 0, g_left = 0, cur_g = -1;
  const int run = (int)(u1 - u0);
  for (int it = 0; it < run; ++it) {
    cp_async_wait<D - 2>();
    __syncwarp();
    // Read this chunk's slot step by step below (fewer live registers); refill the slot consumed in the
    // previous iteration first, so its loads are in flight during the math.
    const int cs = slot;
    issue(slot == 0 ? D - 1 : slot - 1);
    slot = slot + 1 == D ? 0 : slot + 1;

    if (g_left == 0) {                       // a new group (or the first pair of the run / of an n-tile)
      if (cur_g >= 0) flush();
      take_group();
      advance_prefetch();
      prefetch();
      cur_g = cur_g < 0 ? min(KC * c_st / G, NG - 1) : cur_g + 1;
      g_left = cur_g == NG - 1 ? steps - c_st : g_chunks - (c_st - cur_g * g_chunks);
    }
    --g_left;
    u32 xf[NB][4];   // (b0, b1) of the current k32 half's first k16 step, then of its second
#pragma unroll
    for (int t = 0; t < CH; ++t) {
      if ((t & 1) == 0) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {   // lanes 8q..8q+7 address piece 2t + q of token rows 8nb..8nb+7
          const int row = 8 * nb + (lane & 7), c = 2 * t + (lane >> 3);
          ldmatrix_x4(xf[nb], ring_x + cs * (TOK * KC) + row * KC + 8 * swz(row, c));
        }
      }
      const uint4 wv = ring_w[(cs * CH + t) * 32 + lane];
      const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 w = words[j];
        u32 a[4];
        if (SCALE_IN_ACC) {   // exact (q - z) in T
          a[0] = hsub2_bits<T>(int4pair_magic<T>(w), z2[2 * j]);
          a[1] = hsub2_bits<T>(int4pair_magic<T>(w >> 8), z2[2 * j + 1]);
          a[2] = hsub2_bits<T>(int4pair_magic<T>(w >> 4), z2[2 * j]);
          a[3] = hsub2_bits<T>(int4pair_magic<T>(w >> 12), z2[2 * j + 1]);
        } else {
          a[0] = dequant_pair<T>(int4pair_magic<T>(w), z2[2 * j], s2[2 * j]);
          a[1] = dequant_pair<T>(int4pair_magic<T>(w >> 8), z2[2 * j + 1], s2[2 * j + 1]);
          a[2] = dequant_pair<T>(int4pair_magic<T>(w >> 4), z2[2 * j], s2[2 * j]);
          a[3] = dequant_pair<T>(int4pair_magic<T>(w >> 12), z2[2 * j + 1], s2[2 * j + 1]);
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const u32* b = xf[nb] + 2 * (t & 1);
          if (SCALE_IN_ACC) mma_16816<T>(accg[j][nb], a, b[0], b[1]);
          else mma_16816<T>(acc[j][nb], a, b[0], b[1]);
        }
      }
    }
    if (++c_st == steps || it + 1 == run) {   // n-tile (or the warp's run) ends here
      flush();
      emit(c_nt);
      zero_acc();
      c_st = 0;
      ++c_nt;
      cur_g = -1;
      g_left = 0;
    }
  }
  cp_async_wait<0>();
}
