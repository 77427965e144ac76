// gemv_tc.cu: W4A16 matmul for few rows (M <= 8 NB tokens) on tensor cores, A and B swapped:
//   y^T[N, M] = W^T[N, K] @ x^T[K, M],   fp32 accumulation, one final rounding, deterministic.
//
// Why swapped: with few tokens the 16-row A operand of mma.m16n8k16 would be mostly padding. Taking the weights
// as A (16 output channels per mma) and x^T as B (8 tokens per mma) halves the tensor-core work at M <= 8. In the
// tile layout (awq_cupy/layout.py) lane (r, c)'s word i of block (t, ks) is the A fragment of channels 16t + c
// (rows g) and 16t + c + 8 (rows g + 8) for mma k16 step i, whose k are 64ks + 32 (i >> 1) + 8r + 4 (i & 1) +
// (0, 1), (2, 3) (WeightDecoder in common.cuh turns it into exact q - z). x^T enters in the same k order, so a
// lane's x^T fragments of a 32-k half are 8 consecutive values of its token's row: one 16-byte load.
//
// Operands: x T [M, K] (16-byte aligned rows, K % 8 == 0); qtiles uint4 [NT16][KS][32]; scales/zeros [NG, Np]
// of T, permuted per 16-column block (word c of block t holds channels 16t + c and 16t + c + 8), read here as
// u32 words; bias T [N] or null; y T [M, N]; fd_*: common.cuh fastdiv parameters (awq_cupy.plans.gemv_dividers).
//
// Work split, chosen so that no two CTAs share an output (no atomics, no workspace, no second kernel):
// - The 16-column blocks are dealt to the CTAs (one per SM) in contiguous ranges that differ by at most one
//   block; a CTA takes its blocks TW at a time ("column groups"; the last may be short, its missing blocks are
//   neither read nor written).
// - Inside a CTA, the (column group, KD consecutive 64-k blocks) units, group-major, are cut into W equal
//   contiguous runs, one per warp. In the layout a run is one linear byte range per block (a block's K is
//   contiguous), so every warp streams the same number of bytes whatever the shape. KD = 2 (pairs only, groups of
//   whole 64-k blocks): a unit of two blocks x two 64-k blocks has the work of a four-block unit without the
//   fours' padding (docs/design.md §GEMV (gemv_tc)); with an odd block count the last unit's second 64-k block
//   is zeros.
// - A column group covered by one warp is written by that warp. A group shared by consecutive warps (at most
//   the ends of each run) leaves fp32 partials in shared memory (awq_gemv::OneSlot variants: only the segments
//   that continue a group of an earlier warp; the warp where the group starts keeps its own in registers); after
//   one block barrier, the warp in which the group starts adds them in warp order and writes y (two token blocks
//   on sm_90 with one column group per CTA: the CTA's threads share that sum, same order, awq_gemv_shared_groups).
//   The summation order depends on (K, N, G), the GPU and the launch plan, never on timing, so results are bitwise
//   reproducible run to run.
// Memory pipeline: plain 16-byte loads into registers, one or two units ahead: while a warp decodes and
// multiplies unit u, the loads of the next units (TW weight words with the streaming cache hint, the scale/zero
// words of their blocks, and the x^T fragments of their 64 k) are in flight. On the H200 this reaches 3.7 TB/s
// with 2 KB in flight per warp, where a cp.async shared-memory ring of any depth stayed at 1.6-3.5 TB/s
// (docs/design.md §Measured bounds, bench/probes/stream_probe.py). x is read through L1 (every warp of the CTA reads the
// same rows).
// Math: the weights enter the mma as exact (q - z); each group's fp32 sum is multiplied by the channel's scale
// at the group's end, once per group (GA: groups of whole 64-k blocks, or one group) or per 32 k (G % 64 == 32).
// Except the pairs at two token blocks (awq_gemv::Scaled): they multiply by T((q - z) s) like the GEMMs, summed
// straight into the fp32 accumulators, which frees the registers for 16 warps on sm_90
// (docs/design.md §GEMV (gemv_tc)).
// Variants: T x (NB, TW) x GA, and (NB, 2) with KD = 2 (table: awq_cupy/kernels.py); W (warps per CTA) is a launch
// parameter; THR and STG (launch bound, register stages) default to awq_gemv::Bounds of TW x KD blocks per unit and
// are knobs for bench/probes/gemv_stages.py. With AWQ_GEMV_SHAPE defined, a variant is compiled for one launch shape
// (everything but M, x, y and the pointers fixed at compile time; awq_cupy.plans.gemv_specializes).
// Launched by awq_cupy.matmul.
#include "common.cuh"
#include "gemm_units.cuh"

namespace awq_gemv {
// Threads per CTA the kernel is compiled for (registers: the one-unit-ahead pipeline of 4 blocks needs ~160, of
// 4 blocks x 2 token blocks 225-254). sm_75 has fewer registers per thread at 384 threads than the 4-block variant
// needs without spilling.
// Whether a variant multiplies by the rounded weights T((q - z) s) (ScaledDecoder, as the GEMMs and dequantize do)
// instead of the exact (q - z) with the scales applied to fp32 group sums: the plain pairs at two token blocks.
// Without the group sums they fit 16 warps on sm_90 (126-128 registers, no spill), where the scaled decode ran them
// 7-14% faster than the exact one at 12 (and at 16, where the exact decode needs all 128 registers;
// docs/design.md §GEMV (gemv_tc)). awq_cupy.kernels.GemvVariant.scaled states the same rule, checked against this
// one by a static_assert per variant (and plans.rounds_weights tells callers which weights matmul multiplies).
template <int NB, int TW, int KD> struct Scaled {
  static constexpr bool value = NB == 2 && TW == 2 && KD == 1;
};
// Whether a variant needs one fp32 partial slot per warp instead of two: the warp in which a shared column group
// starts keeps its own last segment in registers, so only segments that continue a group take a slot. Halving the
// shared memory leaves a larger L1 for x, where x is large and read by several column groups of the CTA: two token
// blocks with three or four blocks per unit (H200: ~1% faster on Mistral-7B gate_up at M = 16, outputs bitwise the
// same; the other variants measured slower with it: docs/design.md §GEMV (gemv_tc)).
template <int NB, int TW> struct OneSlot {
  static constexpr bool value = NB == 2 && TW >= 3;
};
// Dynamic shared memory for W warps: fp32 partials [2W][TW NB][32] float4 (OneSlot: [W][TW NB][32]). The launch
// takes awq_cupy.kernels.GemvVariant.smem_bytes, checked against this by a static_assert per variant.
template <int NB, int TW> constexpr int smem_bytes(int W) {
  return (OneSlot<NB, TW>::value ? W : 2 * W) * TW * NB * 32 * 16;
}
// The arch's features (awq_cupy.jit.Arch: AWQ_ARCH_GEMV_SCALED_16_WARPS, AWQ_ARCH_GEMV_MID_WARPS) decide the
// bounds of the scaled pairs and of the middle units; awq_cupy.kernels.GemvVariant.max_warps is checked against
// this by a static_assert per variant.
template <int NB, int TW, bool GA, bool SC> struct Bounds {   // TW: blocks per unit (x KD); SC: Scaled
  // (1, 3) with two scale groups per unit spills at 512 threads: it takes the 4-block bound
  static constexpr int threads =
      (TW * NB >= 8) ? 256
      : (SC && AWQ_ARCH_GEMV_SCALED_16_WARPS) ? 512
      : (TW * NB >= 4 || (TW == 3 && !GA)) ? 32 * AWQ_ARCH_GEMV_MID_WARPS : 512;
  // units in registers (S - 1 loading ahead); two scale groups per unit cost too many registers for three
  static constexpr int stages = (NB == 1 && (TW == 1 || (TW == 2 && GA))) ? 3 : 2;
};
}  // namespace awq_gemv

// AWQ_GEMV_TRACE (bench/probes/gemv_trace.py only): thread 0 of each CTA writes %globaltimer at ten points (0..6: entry,
// index arithmetic done, prologue loads issued, pdl_wait returned, first unit computed, main loop done, end; 7..9:
// inside the index arithmetic), lane 0 of a warp that sums a shared column group by itself at two (10: the sum
// starts, 11: the sum is done, before its stores; the last such warp to write wins), and lane 0 of each warp w at
// two more (12 + 2 w: its own loop done, 13 + 2 w: its epilogue done), into `bias`, taken as u64
// [grid][AWQ_TRACE_STRIDE]; no bias is added. Without it: no code.
#ifdef AWQ_GEMV_TRACE
#define AWQ_TRACE_STRIDE 44
#define AWQ_TRACE_AT(cond, j)                                                                         \
  do {                                                                                               \
    if (cond) {                                                                                      \
      u64 t_;                                                                                        \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)::"memory");                              \
      reinterpret_cast<u64*>(const_cast<T*>(bias_in))[blockIdx.x * AWQ_TRACE_STRIDE + (j)] = t_;      \
    }                                                                                                \
  } while (0)
#define AWQ_TRACE(j) AWQ_TRACE_AT(threadIdx.x == 0, j)
#define AWQ_TRACE_WARP(j) AWQ_TRACE_AT((threadIdx.x & 31) == 0, 12 + 2 * (threadIdx.x >> 5) + (j))
#else
#define AWQ_TRACE_AT(cond, j) do {} while (0)
#define AWQ_TRACE(j) do {} while (0)
#define AWQ_TRACE_WARP(j) do {} while (0)
#endif

// floor(n / d) for a launch constant d: on sm_90 a multiply and a shift with the host's parameter fd (common.cuh
// fastdiv: the CTAs start their loads ~1 us sooner); elsewhere the plain division, because with the multiply
// ptxas spills the bf16 (2, 3) variant without aligned groups on sm_86/89. Both are exact.
#if AWQ_CUPY_CC >= 900
#define AWQ_GEMV_DIV(n, d, fd) fastdiv((n), (fd))
#else
#define AWQ_GEMV_DIV(n, d, fd) ((u32)(n) / (u32)(d))
#endif

// Shared column groups (covered by the runs of several warps): the (group, block, token block, lane) items of
// all of them are spread over the CTA's threads; a thread adds its item's contributors' partials in warp order,
// starting with the warp in which the group starts (the same order as that warp would use, so the same bits).
// A group ending inside the run of the warp where it starts was stored by that warp. Called only where the CTA
// has one column group: every warp then stored its one segment, also under awq_gemv::OneSlot (slot w), where
// the group starts at warp 0's first unit. Not inlined: ptxas then schedules the kernel's main loop closer to
// the way it does without this epilogue (tests/sass.py).
template <typename T, int NB, int TW>
__device__ __noinline__ void awq_gemv_shared_groups(const float* __restrict__ partials, const T* __restrict__ bias,
                                                    T* __restrict__ y, int M, int N, int KQ, int b0, int nblk,
                                                    int U) {
  constexpr int ITEMS = TW * NB * 32;
  const int ngroups = (nblk + TW - 1) / TW;
  for (int idx = threadIdx.x; idx < ngroups * ITEMS; idx += blockDim.x) {
    const int g = idx / ITEMS, it = idx - ITEMS * g;
    const int ga = g * KQ, w_lo = ga / U, w_hi = (ga + KQ - 1) / U;   // the warps whose runs cover the group
    const int ln = it & 31, inb = it >> 5, i = inb / NB, nb = inb - NB * i;
    if (w_lo == w_hi || TW * g + i >= nblk) continue;               // stored by that warp; a missing block
    const float4* p = reinterpret_cast<const float4*>(partials) + inb * 32 + ln;
    constexpr int SL = awq_gemv::OneSlot<NB, TW>::value ? 1 : 2;       // slots per warp
    float4 v = p[(SL == 1 || w_lo * U == ga ? SL * w_lo : 2 * w_lo + 1) * ITEMS];   // w_lo's first segment, or
    v = make_float4(0.f + v.x, 0.f + v.y, 0.f + v.z, 0.f + v.w);                    // its last; as a sum from 0
#pragma unroll 4
    for (int w2 = w_lo + 1; w2 <= w_hi; ++w2) {
      const float4 q = p[SL * w2 * ITEMS];                             // the group is w2's first segment
      v.x += q.x; v.y += q.y; v.z += q.z; v.w += q.w;
    }
    const float r[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ch = 16 * (b0 + TW * g + i) + (ln >> 2) + 8 * (e >> 1), tok = 8 * nb + 2 * (ln & 3) + (e & 1);
      if (tok < M && ch < N) {
        float o = r[e];
        if (bias != nullptr) o += Traits<T>::to_float(bias[ch]);
        y[(long long)tok * N + ch] = Traits<T>::from_float(o);
      }
    }
  }
}

// THR, STG: the launch bound and the register stages, by default from awq_gemv::Bounds.
template <typename T, int NB, int TW, bool GA, int KD = 1,
          int THR = awq_gemv::Bounds<NB, TW * KD, GA, awq_gemv::Scaled<NB, TW, KD>::value>::threads,
          int STG = awq_gemv::Bounds<NB, TW * KD, GA, awq_gemv::Scaled<NB, TW, KD>::value>::stages>
__global__ void __launch_bounds__(THR, 1) awq_gemv_tc_kernel(
    const T* __restrict__ x,          // [M, K] activations
    const uint4* __restrict__ qtiles, // [NT16][KS][32] weight blocks
    const u32* __restrict__ scales,   // [NG, Np] permuted scales, as u32 pairs
    const u32* __restrict__ zeros,    // [NG, Np] permuted MAGIC + z, as u32 pairs
    const T* __restrict__ bias_in,    // [N] or nullptr
    T* __restrict__ y,                // [M, N]
    int M, int N, int K,              // problem size (M <= 8 NB)
    int NT16, int KS,                 // 16-column blocks, 64-k blocks per column block
    int G, int NG, int Np,            // group size, number of groups, padded N
    u64 fd_grid, u64 fd_w, u64 fd_kq, u64 fd_g) {   // fast dividers (fastdiv) by gridDim.x, W, KQ and G
  constexpr int SZ = GA ? 1 : 2;      // scale groups per 64-k block
  static_assert(KD == 1 || (KD == 2 && GA), "two 64-k blocks per unit need groups of whole blocks");
  const int KQ = KD == 1 ? KS : (KS + KD - 1) / KD;   // units per column group
  extern __shared__ __align__(16) unsigned char smem[];

  AWQ_TRACE(0);
#ifdef AWQ_GEMV_TRACE
  const T* bias = nullptr;
#else
  const T* bias = bias_in;
#endif
  pdl_trigger();   // the next kernel may launch now: it waits for this one before it touches y or x
#ifdef AWQ_GEMV_SHAPE
  // Compiled for one launch shape (awq_cupy.kernels.gemv_shape_family; the arguments still arrive and must match):
  // the index arithmetic folds to constants and the loop needs no parameter loads. H200: the first weights go out
  // earlier, ~3% off the Mistral-7B layers at M = 1 (docs/design.md §GEMV (gemv_tc)).
  N = AWQ_GEMV_N; K = AWQ_GEMV_K; NT16 = AWQ_GEMV_NT16; KS = AWQ_GEMV_KS; G = AWQ_GEMV_G; NG = AWQ_GEMV_NG;
  Np = AWQ_GEMV_NP;
  fd_grid = AWQ_GEMV_FD_GRID; fd_w = AWQ_GEMV_FD_W; fd_kq = AWQ_GEMV_FD_KQ; fd_g = AWQ_GEMV_FD_G;
#ifdef AWQ_GEMV_M
  M = AWQ_GEMV_M;   // and for one token count (plans.gemv_compiled_tokens): the token predicates fold
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = AWQ_GEMV_W;
#else
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
#endif
  const int g8 = lane >> 2, t4 = lane & 3;

  // This CTA's 16-column blocks [b0, b0 + nblk), taken TW at a time, and this warp's units [u0, u1).
  const int b0 = (int)AWQ_GEMV_DIV(blockIdx.x * NT16, gridDim.x, fd_grid);
  const int nblk = (int)AWQ_GEMV_DIV((blockIdx.x + 1) * NT16, gridDim.x, fd_grid) - b0;
  if (nblk >= 0) AWQ_TRACE(7);
  const int units = (nblk + TW - 1) / TW * KQ;
  const int U = (int)AWQ_GEMV_DIV(units + W - 1, W, fd_w);
  const int u0 = min(units, warp * U), u1 = min(units, u0 + U);
  const int run = u1 - u0;
  if (run >= 0) AWQ_TRACE(8);

  // Shared memory: fp32 partials [2W][TW NB][32] float4 (slot 2w: warp w's first segment, 2w + 1: its last;
  // awq_gemv::OneSlot: [W][TW NB][32], slot w: warp w's first segment where it continues a group of an earlier
  // warp; lane-minor, so a warp's float4 accesses do not conflict).
  constexpr bool ONE_SLOT = awq_gemv::OneSlot<NB, TW>::value;
  float* partials = reinterpret_cast<float*>(smem);

  // ---- load cursor: the next unit to load, as running values (no divisions in the loop) -----------------
  int l_cg = (int)AWQ_GEMV_DIV(u0, KQ, fd_kq), l_ks = KD * (u0 - KQ * l_cg);   // column group (relative), 64-k block
  int l_nv = min(TW, nblk - TW * l_cg);                   // valid blocks in the column group
  const int grp = (int)AWQ_GEMV_DIV(64 * l_ks, G, fd_g);  // the unit's scale group
  int l_gk = NG == 1 ? 64 * l_ks : 64 * l_ks - G * grp;  // k offset of the unit inside its group
  const long long blk_words = (long long)KS * 32;         // uint4 per block
  const uint4* l_w = qtiles + (long long)(b0 + TW * l_cg) * blk_words + (long long)l_ks * 32 + lane;
  const int np2 = Np >> 1;                                // u32 words per group row
  // scale and zero words of (channel 16 b + g8, + 8) of this unit's group, for the column group's first block b
  const long long sz0 = (long long)(NG == 1 ? 0 : grp) * np2 + 8 * (b0 + TW * l_cg) + g8;
  const u32* l_s = scales + sz0;
  const u32* l_z = zeros + sz0;
  if (sz0 >= 0 && l_gk >= 0) AWQ_TRACE(9);
  // x^T fragments: in the layout's mma k order (layout.k_of_kappa) lane (g8, t4)'s b0, b1 of k16 steps 2h and
  // 2h + 1 are the 8 consecutive values x[token 8 nb + g8, 64 ks + 32 h + 8 t4 .. + 7]: one 16-byte load per half.
  const T* xrow[NB];
  bool xtok[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int tok = 8 * nb + g8;
    xtok[nb] = tok < M;
    xrow[nb] = x + (long long)(xtok[nb] ? tok : 0) * K + 8 * t4;
  }

  struct Stage {             // per 64-k block d of the unit:
    uint4 w[KD][TW];
    u32 xb[NB][KD][8];      // (b0, b1) of the block's 4 k16 steps: words 2t, 2t + 1 of step t
    u32 s[KD][SZ][TW], z[KD][SZ][TW];
  };
  auto load_x = [&](Stage& st, int k0) {   // the x^T fragments of the unit starting at k0
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int d = 0; d < KD; ++d)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = k0 + 64 * d + 32 * h;                 // + 8 t4 inside xrow; K % 8 == 0
          const uint4 v = (xtok[nb] && k + 8 * t4 < K) ? ld_act16(xrow[nb] + k)
                                                       : make_uint4(0u, 0u, 0u, 0u);
          st.xb[nb][d][4 * h] = v.x;
          st.xb[nb][d][4 * h + 1] = v.y;
          st.xb[nb][d][4 * h + 2] = v.z;
          st.xb[nb][d][4 * h + 3] = v.w;
        }
  };
  // The next unit's weights, scales, zeros (and x unless with_x is false), then advance the cursor.
  auto load = [&](Stage& st, bool with_x) {
#pragma unroll
    for (int d = 0; d < KD; ++d) {
      const bool real = d == 0 || l_ks + d < KS;            // a unit's second block past KS: zeros, never read
#pragma unroll
      for (int i = 0; i < TW; ++i)
        st.w[d][i] = i < l_nv && real ? __ldcs(l_w + i * blk_words + 32 * d) : make_uint4(0u, 0u, 0u, 0u);
    }
    const int k0 = 64 * l_ks;
    if (with_x) load_x(st, k0);
#pragma unroll
    for (int d = 0; d < KD; ++d) {
      const bool real = d == 0 || l_ks + d < KS;
      // KD = 2 (whole-block groups): the second block starts the next group when the first ends one
      const int nextd = (d == 1 && NG != 1 && l_gk + 64 >= G) ? np2 : 0;
#pragma unroll
      for (int h = 0; h < SZ; ++h) {
        // the block's second 32 k may start the next group (GA false); past K any group would do, keep this one
        const int next = nextd + ((!GA && h == 1 && l_gk + 32 >= G && k0 + 32 < K) ? np2 : 0);
#pragma unroll
        for (int i = 0; i < TW; ++i) {
          st.s[d][h][i] = i < l_nv && real ? __ldg(l_s + next + 8 * i) : 0u;
          st.z[d][h][i] = i < l_nv && real ? __ldg(l_z + next + 8 * i) : 0u;
        }
      }
    }
    // advance to the next unit
    l_w += 32 * KD;
    l_gk += 64 * KD;
    if (l_gk >= G) { l_gk -= G; l_s += np2; l_z += np2; }
    if ((!GA || KD == 2) && l_gk >= G) { l_gk -= G; l_s += np2; l_z += np2; }
    if constexpr (KD == 1) {
      if (++l_ks == KS) {                                 // next column group
        l_ks = 0;
        ++l_cg;
        l_nv = min(TW, nblk - TW * l_cg);
        l_gk = 0;
        l_w += (TW - 1) * blk_words;
        l_s = scales + 8 * (b0 + TW * l_cg) + g8;
        l_z = zeros + 8 * (b0 + TW * l_cg) + g8;
      }
    } else {
      l_ks += KD;
      if (l_ks >= KS) {                                   // next column group (past KS by l_ks - KS blocks)
        l_w += (TW - 1) * blk_words - 32 * (l_ks - KS);
        l_ks = 0;
        ++l_cg;
        l_nv = min(TW, nblk - TW * l_cg);
        l_gk = 0;
        l_s = scales + 8 * (b0 + TW * l_cg) + g8;
        l_z = zeros + 8 * (b0 + TW * l_cg) + g8;
      }
    }
  };

  float acc[TW][NB][4], accg[TW][NB][4];
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][nb][e] = accg[i][nb][e] = 0.f;

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
  auto partial_ptr = [&](int slot) { return reinterpret_cast<float4*>(partials) + (slot * (TW * NB)) * 32 + lane; };
  auto to_partials = [&](int slot) {
    float4* p = partial_ptr(slot);
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
        p[(i * NB + nb) * 32] = make_float4(acc[i][nb][0], acc[i][nb][1], acc[i][nb][2], acc[i][nb][3]);
  };

  int c_ks = l_ks, c_cg = l_cg;                    // relative column group being consumed
  bool seg_first = true, seg_whole_start = c_ks == 0;
  // Two token blocks on sm_90 (measured there), one column group per CTA: the group's sum is spread over the
  // CTA after the loop (awq_gemv_shared_groups), which reads every warp's segment from its slot.
  constexpr bool CTA_SUM_VARIANT = NB == 2 && (TW != 3 || GA) && AWQ_CUPY_CC >= 900;
  const bool cta_sum = CTA_SUM_VARIANT && nblk <= TW;
  // GA: units left in the current scale group (its fp32 sums are scaled once, at the group's end).
  const int upg = NG == 1 ? KS : max(1, G / 64);
  int g_left = NG == 1 ? KS - c_ks : GA ? upg - (c_ks - upg * grp) : 1;   // (GA: upg = G / 64)

  // Decode + multiply one unit, then the group / segment bookkeeping.
  auto compute = [&](const Stage& st, int it) {
    const bool seg_end = (KD == 1 ? c_ks + 1 == KS : c_ks + KD >= KS) || it + 1 == run;
    auto flush = [&](int d, int h) {   // acc += s * accg per channel; accg = 0
#pragma unroll
      for (int i = 0; i < TW; ++i) {
        const T* sp = reinterpret_cast<const T*>(&st.s[d][h][i]);
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
    // The scaled pairs (awq_gemv::Scaled) sum T((q - z) s) straight into acc; the others the exact (q - z) into
    // accg, scaled per group by flush().
    constexpr bool SC = awq_gemv::Scaled<NB, TW, KD>::value;
    float (&sums)[TW][NB][4] = SC ? acc : accg;
#pragma unroll
    for (int d = 0; d < KD; ++d) {
#pragma unroll
      for (int h = 0; h < SZ; ++h) {
        ScaledDecoder<T> dec[TW];                    // !SC: only its exact part, dec[i].dec
#pragma unroll
        for (int i = 0; i < TW; ++i) {
          if constexpr (SC) dec[i].set(st.z[d][h][i], st.s[d][h][i]);
          else dec[i].dec.set_zeros(st.z[d][h][i]);
        }
#pragma unroll
        for (int tt = 0; tt < 4 / SZ; ++tt) {
          const int t = h * (4 / SZ) + tt;           // k16 step of the block
#pragma unroll
          for (int i = 0; i < TW; ++i) {
            u32 a[4];
            const uint4& w = st.w[d][i];
            const u32 word = t == 0 ? w.x : t == 1 ? w.y : t == 2 ? w.z : w.w;
            if constexpr (SC) dec[i].fragment(word, a);
            else dec[i].dec.a_fragment(word, a);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
              mma_16816<T>(sums[i][nb], a, st.xb[nb][d][2 * t], st.xb[nb][d][2 * t + 1]);
          }
        }
        if (!SC && !GA) flush(d, h);                 // two groups per block: each half is its own group
      }
      if constexpr (KD == 1) {                       // (SC implies KD = 1)
        if (GA && !SC) {
          if (--g_left == 0 || seg_end) flush(0, 0);
          if (g_left == 0) g_left = upg;
        }
      } else if (d == 0 || c_ks + d < KS) {          // a block past KS (zero weights and x) has no group
        const bool last = d == KD - 1 || c_ks + d + 1 >= KS;   // the unit's last block
        if (--g_left == 0 || (seg_end && last)) flush(d, 0);
        if (g_left == 0) g_left = upg;
      }
    }
    // Segment (one column group inside this run) ends at the group's last unit or at the run's end.
    if (seg_end) {
      c_ks += KD;
      if (KD > 1 && c_ks > KS) c_ks = KS;
      // OneSlot: a segment that starts its group here and ends with the run, short of the group's end, stays in
      // acc, and this warp sums the group after the loop (unless the CTA-wide sum reads it from its slot).
      const bool kept = ONE_SLOT && seg_whole_start && c_ks != KS && !cta_sum;
      if (seg_whole_start && c_ks == KS) store(c_cg, acc);
      else if (!kept) to_partials(ONE_SLOT ? warp : seg_first ? 2 * warp : 2 * warp + 1);
      if (!kept) {
#pragma unroll
        for (int i = 0; i < TW; ++i)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][nb][e] = 0.f;
      }
      seg_first = false;
      seg_whole_start = true;
      if (c_ks == KS) { c_ks = 0; ++c_cg; }
    } else {
      c_ks += KD;
    }
  };

  // S stages in registers: the loads of S - 1 units are in flight while one is computed (S = 3 where the
  // registers allow it under the launch bound, else 2).
  constexpr int S = STG;
  Stage st[S];
  // Prologue: the first units' weights are requested before the previous kernel of the stream has finished
  // (programmatic dependent launch, common.cuh); x only after pdl_wait().
  AWQ_TRACE(1);
  int pk[S - 1];
#pragma unroll
  for (int j = 0; j < S - 1; ++j)
    if (j < run) {
      pk[j] = 64 * l_ks;
      load(st[j], false);
    }
  AWQ_TRACE(2);
  pdl_wait();
  AWQ_TRACE(3);
#pragma unroll
  for (int j = 0; j < S - 1; ++j)
    if (j < run) load_x(st[j], pk[j]);
  for (int it = 0; it < run; it += S) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      if (it + j >= run) break;
      if (it + j + S - 1 < run) load(st[(j + S - 1) % S], true);
      compute(st[j], it + j);
      if (it + j == 0) AWQ_TRACE(4);
    }
  }
  AWQ_TRACE_WARP(0);
  __syncthreads();
  AWQ_TRACE(5);

  // cta_sum: the group's sum spread over the CTA. With several groups their first warps sum them side by side
  // already (gate_up: slower spread). One token block (slower), the (2, 3) variant without aligned groups (at its
  // register bound) and the other archs keep the sum by the group's first warp.
  // (Tested again for the other variants: reading the flag computed before the loop changes their code.)
  if (ONE_SLOT ? cta_sum : CTA_SUM_VARIANT && nblk <= TW) {
    awq_gemv_shared_groups<T, NB, TW>(partials, bias, y, M, N, KQ, b0, nblk, U);
  } else {
    // Shared column groups: the warp in which a group starts sums the partials of its contributors in warp
    // order (OneSlot: its own from acc). Only the run's last group can start here and continue past the run's
    // end.
    if (run > 0) {
      const int tl = (int)AWQ_GEMV_DIV(u1 - 1, KQ, fd_kq);
      if (tl * KQ >= u0 && (tl + 1) * KQ > u1) {
        const int w_hi = ((tl + 1) * KQ - 1) / U;
        AWQ_TRACE_AT(lane == 0, 10);
        float v[TW][NB][4];
#pragma unroll
        for (int i = 0; i < TW; ++i)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[i][nb][e] = ONE_SLOT ? 0.f + acc[i][nb][e] : 0.f;   // a sum from 0
        for (int w2 = ONE_SLOT ? warp + 1 : warp; w2 <= w_hi; ++w2) {
          const float4* p = partial_ptr(ONE_SLOT ? w2 : w2 == warp ? (tl * KQ == u0 ? 2 * warp : 2 * warp + 1)
                                                                   : 2 * w2);
#pragma unroll
          for (int i = 0; i < TW; ++i)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
              const float4 q = p[(i * NB + nb) * 32];
              v[i][nb][0] += q.x; v[i][nb][1] += q.y; v[i][nb][2] += q.z; v[i][nb][3] += q.w;
            }
        }
        AWQ_TRACE_AT(lane == 0, 11);
        store(tl, v);
      }
    }
  }
#ifdef AWQ_GEMV_TRACE
  AWQ_TRACE_WARP(1);
  __syncthreads();
  AWQ_TRACE(6);
#endif
}
