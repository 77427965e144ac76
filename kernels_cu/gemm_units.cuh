// gemm_units.cuh: what the two swapped-operand GEMM kernels share (gemm_tc.cu awq_gemm_sw_kernel, mma.sync;
// gemm_wg.cu awq_gemm_wg_kernel, wgmma): the register-fed stream of 64-k units, the scaled weight decoder and the
// epilogue. Operands and layouts as documented at the top of gemm_tc.cu.
#pragma once
#include "common.cuh"

namespace awq_units {
// x tile rows are 64 halves = 8 chunks of 16 B. The wgmma kernel's rows (awq_tile_x_kernel) hold x^T in the
// layout's mma k order with chunk c of row r stored at c ^ (r % 8) (the 128-byte swizzle of wgmma).
AWQ_DEVICE int swz(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }
// The mma.sync kernel's rows hold x in natural k order with chunk c of row r at c ^ (4 (r % 2)): its lanes read
// 16 bytes each, (row g, chunk 4 h + t) for g = 0..7, t = 0..3, and the two rows of each 8-lane phase then fall
// in different halves of the banks.
AWQ_DEVICE int swz_sw(int row, int chunk) { return row * 8 + (chunk ^ ((row & 1) << 2)); }

AWQ_DEVICE u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
}  // namespace awq_units

// The exact (q - z) fragment of one 16-column block times its channels' scales: T((q - z) * s), one rounding
// (the values awq_cupy.dequantize produces). set() takes the block's zero and scale words of one group.
template <typename T> struct ScaledDecoder {
  WeightDecoder<T> dec;
  u32 slo, shi;   // scales of channels c and c + 8, each broadcast to both halves
  AWQ_DEVICE void set(u32 zw, u32 sw) {
    dec.set_zeros(zw);
    slo = bcast_lo(sw);
    shi = bcast_hi(sw);
  }
  AWQ_DEVICE void fragment(u32 w, u32 (&a)[4]) const {
    dec.a_fragment(w, a);
    a[0] = hmul2_bits<T>(a[0], slo);
    a[1] = hmul2_bits<T>(a[1], shi);
    a[2] = hmul2_bits<T>(a[2], slo);
    a[3] = hmul2_bits<T>(a[3], shi);
  }
};

// One thread's stream of 64-k units, as running values (no divisions in the loop): per unit its warp's TW weight
// words (streaming hint), their scale and zero words for the unit's SZ groups (SZ = 2 when G % 64 == 32) and this
// thread's CPT 16-byte chunks of the BM x 64 x tile (zero past M and K). load() fills a Stage and advances;
// store_x() writes a Stage's chunks into a shared-memory slot (128-byte rows in natural k order, swizzled by
// awq_units::swz_sw).
// WX = false: weights, scales and zeros only, x unused (may be null; the wgmma kernel brings x into shared
// memory by bulk copies).
template <typename T, int TW, int SZ, int BM, int THREADS, bool WX = true> struct UnitStream {
  static constexpr int CPT = WX ? (BM * 8 + THREADS - 1) / THREADS : 0;   // x chunks per thread per unit
  struct Stage {
    uint4 w[TW];
    u32 s[SZ][TW], z[SZ][TW];
    uint4 xc[CPT > 0 ? CPT : 1];
  };

  // x chunk r of this thread: row tid / 8 + (THREADS / 8) r of the token tile, k offset 8 (tid % 8) of the unit;
  // bit r of xok: the chunk exists and its row is < M.
  const T* xsrc;
  long long xstep;
  u32 xok, xdst;
  int xk, tid;
  // weights, scales, zeros of this warp's blocks [blk0, blk0 + nvalid) at the next unit
  const uint4* l_w;
  long long blk_words;
  const u32 *scales, *zeros;
  int l_g, l_gk, l_k;   // group of the unit, k offset inside it, first k of the unit
  int np2, sz_col, nvalid, G, NG, K;

  AWQ_DEVICE UnitStream(const T* x, const uint4* qtiles, const u32* scales_, const u32* zeros_, int M, int K_,
                        int NT16, int KS, int G_, int NG_, int Np, int m0, int ub, int blk0, int tid_, int lane)
      : scales(scales_), zeros(zeros_), G(G_), NG(NG_), K(K_) {
    tid = tid_;
    xk = 8 * (tid & 7);
    xsrc = nullptr;
    xstep = 0;
    xok = xdst = 0;
    if constexpr (WX) {
      xsrc = x + (long long)min(m0 + (tid >> 3), M - 1) * K + xk;
      xstep = (long long)(THREADS / 8) * K;
#pragma unroll
      for (int r = 0; r < CPT; ++r) {
        const int c = tid + THREADS * r;
        if (c < BM * 8 && m0 + (c >> 3) < M) xok |= 1u << r;
      }
      xdst = (u32)(awq_units::swz_sw(tid >> 3, tid & 7) * 16);
    }
    blk_words = (long long)KS * 32;
    l_w = qtiles + (long long)blk0 * blk_words + (long long)ub * 32 + lane;
    l_g = min(64 * ub / G, NG - 1);
    l_gk = (64 * ub) % G;
    l_k = 64 * ub;
    np2 = Np >> 1;
    sz_col = 8 * blk0 + (lane >> 2);
    nvalid = max(0, min(TW, NT16 - blk0));
  }

  AWQ_DEVICE void load(Stage& st) {
#pragma unroll
    for (int i = 0; i < TW; ++i)
      st.w[i] = i < nvalid ? __ldcs(l_w + i * blk_words) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int h = 0; h < SZ; ++h) {
      // SZ = 2: the unit's second 32 k may start the next group (G % 64 == 32); never past the last group
      const int g = (h == 1 && l_gk + 32 >= G) ? min(l_g + 1, NG - 1) : l_g;
      const int off = g * np2 + sz_col;
#pragma unroll
      for (int i = 0; i < TW; ++i) {
        st.s[h][i] = i < nvalid ? __ldg(scales + off + 8 * i) : 0u;
        st.z[h][i] = i < nvalid ? __ldg(zeros + off + 8 * i) : 0u;
      }
    }
    const bool kin = WX && l_k + xk < K;
#pragma unroll
    for (int r = 0; r < CPT; ++r)
      st.xc[r] = (((xok >> r) & 1u) && kin) ? ld_act16(xsrc + r * xstep + l_k)
                                           : make_uint4(0u, 0u, 0u, 0u);
    l_w += 32;
    l_k += 64;
    l_gk += 64;
    while (l_gk >= G) { l_gk -= G; l_g = min(l_g + 1, NG - 1); }
  }

  AWQ_DEVICE void store_x(const Stage& st, unsigned char* slot) const {
#pragma unroll
    for (int r = 0; r < CPT; ++r)
      if (tid + THREADS * r < BM * 8)   // rows THREADS / 8 apart keep their parity, hence the swizzle
        *reinterpret_cast<uint4*>(slot + xdst + r * (THREADS / 8) * 128) = st.xc[r];
  }
};

// Epilogue of a warp's TW blocks x NB token blocks: value(i, j, e) is the accumulator of block blk0 + i, channel
// 16 (blk0 + i) + g + 8 (e >> 1), token m0 + 8 j + 2 t + (e & 1) (mma C / wgmma D layout, g = lane / 4, t = lane
// % 4). Without split-K it adds the bias and writes y in T; with split-K the fp32 partials of split blockIdx.y, rows
// ws_ld floats apart, from channel ws_col0 on (a tail launch's workspace holds its own columns only).
template <typename T, int TW, int NB, typename Value>
AWQ_DEVICE void store_swapped_tile(Value value, const T* __restrict__ bias, T* __restrict__ y, float* __restrict__ ws,
                                   int M, int N, int ws_ld, int ws_col0, int m0, int blk0, int nvalid, int lane) {
  const int g8 = lane >> 2, t4 = lane & 3;
  const bool split = gridDim.y > 1;
#pragma unroll
  for (int i = 0; i < TW; ++i) {
    if (i >= nvalid) continue;
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int ch = 16 * (blk0 + i) + g8 + 8 * e2;
      if (ch >= N) continue;
      const float bv = (!split && bias != nullptr) ? Traits<T>::to_float(bias[ch]) : 0.f;
#pragma unroll
      for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int tok = m0 + 8 * j + 2 * t4 + e1;
          if (tok >= M) continue;
          const float v = value(i, j, 2 * e2 + e1);
          if (split) ws[((long long)blockIdx.y * M + tok) * ws_ld + (ch - ws_col0)] = v;
          else y[(long long)tok * N + ch] = Traits<T>::from_float(v + bv);
        }
    }
  }
}
