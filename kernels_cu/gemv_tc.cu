// gemv_tc.cu: W4A16 matmul for few rows (M <= 32) on tensor cores with A and B swapped:
//   y^T[N, M] = W^T[N, K] @ x^T[K, M],   fp32 accumulation, one final rounding.
//
// Why swapped: with M <= 8 the 16-row A operand of mma.m16n8k16 would be mostly padding. Taking the weights as
// A (16 output channels per mma) and x^T as B (8 tokens per mma) halves the tensor-core work at M <= 8 and
// wastes none at M = 8, 16, 32. The weight tile layout (awq_cupy/layout.py) serves both roles: lane (r, c)'s
// word j, converted as (w, w >> 8, w >> 4, w >> 12), is the A fragment {a0, a1, a2, a3} of channels
// 16j + c (rows g) and 16j + c + 8 (rows g + 8) at k (2r, 2r+1), (2r+8, 2r+9).
//
// Operands: as gemm_tc.cu (x T [M, K]; qtiles uint4 [NT][KT][32]; scales/zeros T [NG, Np] permuted; bias T [N]
// or null; y T [M, N]); ws float [S, M, Np] split partials and counters int [>= NT] (zero, self-resetting)
// when the grid has S > 1 k-splits.
// Structure: no shared memory in the main loop and no block barrier: CTA = KW warps on one 64-column n-tile,
// each warp streams a contiguous k range of its split straight from global memory into registers (16 B per lane
// per k16 step, evict-first, P steps in flight in a ring of register slots) and loads its x fragments through L1 (x is tiny and
// shared by every CTA). SCALE_IN_ACC (NB <= 2): the weights enter the mma as exact (q - z) and the fp32 partial
// sum of each group is multiplied by the channel's scale at the group's end (removes 16 multiplies per step);
// otherwise (q - z) * s is formed in T like gemm_tc. Warps reduce through shared memory in a fixed order; k-split
// CTAs write fp32 partials and the last CTA of an n-tile (atomic counter) sums them in split order.
// Variants: T x NB (token blocks of 8: 1, 2, 4) (table: awq_cupy/kernels.py). Launched by awq_cupy.matmul.
#include "common.cuh"

namespace awq_gemv {
constexpr int KW = 8;        // warps per CTA, all on one n-tile
}

template <typename T, int NB>
__global__ void __launch_bounds__(32 * awq_gemv::KW, NB <= 2 ? 2 : 1) awq_gemv_tc_kernel(
    const T* __restrict__ x,          // [M, K] activations
    const uint4* __restrict__ qtiles, // [NT][KT][32] weight tiles
    const T* __restrict__ scales,     // [NG, Np] permuted scales
    const T* __restrict__ zeros,      // [NG, Np] permuted MAGIC + z
    const T* __restrict__ bias,       // [N] or nullptr
    T* __restrict__ y,                // [M, N]
    float* __restrict__ ws,           // [S, M, Np] split partials (S > 1)
    int* __restrict__ counters,       // [NT] arrival counters, zero between launches (S > 1)
    int M, int N, int K,              // problem size
    int NT, int KT,                   // n-tiles, k16 tiles (padded)
    int G, int NG,                    // group size, number of groups
    int steps_per_split) {            // k16 steps per grid.y split
  using namespace awq_gemv;
  constexpr bool SCALE_IN_ACC = NB == 1;
  constexpr int TOK = 8 * NB;
  constexpr int P = NB == 1 ? 6 : 4;   // k16 steps in flight per warp (ring of register slots; x fragments too)
  extern __shared__ __align__(16) float red[];   // [KW][64][TOK]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nt = blockIdx.x, split = blockIdx.y, S = gridDim.y;
  const int Np = NT * 64;
  const int steps = (K + 15) >> 4;                 // k16 steps holding real k
  const int s0 = split * steps_per_split, s1 = min(steps, s0 + steps_per_split);
  const int per_w = (max(0, s1 - s0) + KW - 1) / KW;
  const int w0 = s0 + warp * per_w, w1 = min(s1, w0 + per_w);
  const uint4* wp = qtiles + (long long)nt * KT * 32 + lane;
  const int g8 = lane >> 2, kofs = 2 * (lane & 3);
  const u64 policy = evict_first_policy();

  const T* xrow[NB];
  bool tok_ok[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int tok = g8 + 8 * nb;
    tok_ok[nb] = tok < M;
    xrow[nb] = x + (long long)(tok_ok[nb] ? tok : 0) * K;
  }

  float acc[4][NB][4];
  float accg[SCALE_IN_ACC ? 4 : 1][NB][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[j][nb][e] = 0.f;
        if (SCALE_IN_ACC) accg[j][nb][e] = 0.f;
      }

  uint4 wb[P];
  u32 xb[P][NB][2];
  auto fetch = [&](int s, int p) {
    const bool ok = s < w1;
    wb[p] = ok ? ldg_stream16(wp + (long long)s * 32, policy) : make_uint4(0, 0, 0, 0);
    const int k = 16 * s + kofs;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const bool v0 = ok && tok_ok[nb] && k < K, v1 = ok && tok_ok[nb] && k + 8 < K;
      xb[p][nb][0] = v0 ? __ldg(reinterpret_cast<const u32*>(xrow[nb] + k)) : 0u;
      xb[p][nb][1] = v1 ? __ldg(reinterpret_cast<const u32*>(xrow[nb] + k + 8)) : 0u;
    }
  };

  u32 z2[8], s2[8];
  float sf[8];
  int cur_g = -1;
  auto flush = [&]() {   // acc += s * accg (per channel: c rows g -> m = 2j, rows g + 8 -> m = 2j + 1)
    if (SCALE_IN_ACC) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[j][nb][e] = fmaf(sf[2 * j + (e >> 1)], accg[j][nb][e], acc[j][nb][e]);
            accg[j][nb][e] = 0.f;
          }
    }
  };
  auto set_group = [&](int g) {
    const long long off = (long long)g * Np + nt * 64 + g8 * 8;
    const uint4 zv = __ldg(reinterpret_cast<const uint4*>(zeros + off));
    const uint4 sv = __ldg(reinterpret_cast<const uint4*>(scales + off));
    const u32 zw[4] = {zv.x, zv.y, zv.z, zv.w}, sw[4] = {sv.x, sv.y, sv.z, sv.w};
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

#pragma unroll
  for (int p = 0; p < P; ++p) fetch(w0 + p, p);

  // Ring of P register slots: consume slot p, then refill it with the step P ahead, so P loads stay in flight.
  for (int s = w0; s < w1; s += P) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      // Past w1 the slot holds zero words and zero x (fetch predicates them off): harmless, no branch.
      const uint4 wc = wb[p];
      u32 xc[NB][2];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) { xc[nb][0] = xb[p][nb][0]; xc[nb][1] = xb[p][nb][1]; }
      fetch(s + p + P, p);
      const int g = min((16 * (s + p)) / G, NG - 1);
      if (g != cur_g) {
        if (cur_g >= 0) flush();
        set_group(g);
        cur_g = g;
      }
      const u32 words[4] = {wc.x, wc.y, wc.z, wc.w};
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
          if (SCALE_IN_ACC) mma_16816<T>(accg[j][nb], a, xc[nb][0], xc[nb][1]);
          else mma_16816<T>(acc[j][nb], a, xc[nb][0], xc[nb][1]);
        }
      }
    }
  }
  if (cur_g >= 0) flush();

  // Reduce the KW warps' partials through shared memory. c fragment e of (j, nb): channel 16j + g8 + 8(e >> 1),
  // token 8nb + kofs + (e & 1).
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ch = 16 * j + g8 + 8 * (e >> 1), tok = 8 * nb + kofs + (e & 1);
        red[(warp * 64 + ch) * TOK + tok] = acc[j][nb][e];
      }
  __syncthreads();
  const int mlim = min(M, TOK);
  for (int i = threadIdx.x; i < 64 * TOK; i += 32 * KW) {
    const int tok = i / 64, ch = i % 64;        // channel fastest: coalesced stores of y rows
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) v += red[(w * 64 + ch) * TOK + tok];
    red[ch * TOK + tok] = v;                    // slot of warp 0 (each element read and written by one thread)
  }
  __syncthreads();

  if (S > 1) {
    for (int i = threadIdx.x; i < 64 * TOK; i += 32 * KW) {
      const int tok = i / 64, ch = i % 64;
      if (tok < mlim) ws[((long long)split * M + tok) * Np + nt * 64 + ch] = red[ch * TOK + tok];
    }
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(counters + nt, 1) == S - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }
  for (int i = threadIdx.x; i < 64 * TOK; i += 32 * KW) {
    const int tok = i / 64, ch = i % 64, n = nt * 64 + ch;
    if (tok >= mlim || n >= N) continue;
    float v;
    if (S > 1) {
      v = 0.f;
      for (int sp = 0; sp < S; ++sp) v += __ldcg(ws + ((long long)sp * M + tok) * Np + n);
    } else {
      v = red[ch * TOK + tok];
    }
    if (bias != nullptr) v += Traits<T>::to_float(bias[n]);
    y[(long long)tok * N + n] = Traits<T>::from_float(v);
  }
  if (S > 1 && threadIdx.x == 0) counters[nt] = 0;   // ready for the next launch (stream-ordered)
}
