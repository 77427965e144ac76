// gemm_wb.cu: PROTOTYPE (bench/probes/wb_probe.py only, not on awq_cupy.matmul's path): W4A16 matmul for M <= 64 on
// Hopper wgmma with the weights as the B operand, decoded by producer warps into shared memory, and x as A.
// Status (H200, docs/history.md v33, v34): correct, and ~1.3x slower than gemm_wg.cu at M = 64 (Mistral-7B sum 123
// against 92 us with x pre-tiled outside the timing, v34's lean producer loop; v33's was 133); its producers alone
// take 108 us for that sum (~10 decoded weights per SM cycle), its consumers alone would give 64-68 us. Measured
// and taken out again: a shared-memory-only release with relaxed arrivals (v33, no change; commit 96eab44), a
// thread-private cp.async ring for the weights, scales and zeros (v33, v34: slower in the full kernel; branch
// wb-ring-v34) and 16 producer warps with setmaxnreg (v34: -3%; branch wb-cw-pw-v34). Until v34 the consumers
// released a unit's stage after waiting for the previous unit's wgmmas only, and the next unit's ldmatrix could
// overwrite A registers of wgmmas still in flight: wrong outputs whenever the producers ran ahead (see below).
//
// Why (docs/history.md v33): the fused GEMM (gemm_wg.cu) decodes its weights in the warps that issue the wgmmas and
// reaches ~12-15 decoded weights per SM cycle at M = 64, where the tensor cores could take 32. Probe: 8 warps that
// only decode and store run at 37.6 weights per cycle alone and 16 beside a full-rate m64n256k16 stream.
//
// CTA: 8 consumer warps (two warpgroups, 128 channels each; CW = 4: one of 256) + 8 producer warps; 256 channels x
// 64 tokens; grid (column tiles of 256 channels, K splits). Per 64-k unit, stage s of S:
// - B (32 KB): the 256 channels' decoded weights, one 128-byte row of 64 k per channel in natural k order, 16-byte
//   chunk q of row n at q ^ (n % 8) (the wgmma 128-byte swizzle, K-major). Producer thread (warp pw, lane l) takes
//   tile-layout lane (c, r) = (l % 8, l / 8) of blocks pw and pw + 8: its uint4 holds channels c and c + 8 at
//   k 8 r .. 8 r + 7 (words 0, 1) and 32 + 8 r .. + 7 (words 2, 3), i.e. 16-byte chunks r and 4 + r of both rows
//   (layout_k in common.cuh): four 16-byte stores, conflict-free (a quarter warp has c = 0..7).
// - x (9 KB): the 64 token rows' 128 bytes of the unit, natural order, rows 144 bytes apart (conflict-free
//   ldmatrix), brought by bulk copies (producer warp 0, one per row), zero past M (written once) and past K.
//   H200: 64 row copies per unit cost ~2-3 us per unit (small bulk copies are ~70 SM cycles each, v14), so XT
//   takes x as per-unit images made beforehand ([KS][64][72]) and copies each in one piece (timing probe).
// - full[s]: one arrival per producer warp (its lanes' proxy fences, then __syncwarp) + the x bytes; empty[s]: one
//   arrival per consumer warp once the wgmmas of that unit have completed.
// Producers: weights, scales and zeros in two register batches of D / 2 units, from running cursors; store offsets
// precomputed (v34: ~235 SASS instructions per unit and thread instead of ~300).
// Consumers: per unit, 4 ldmatrix.x4 (their 16 tokens' A fragments), 4 x m64n128k16 (CW = 4: m64n256k16), waited
// for before the next unit (v34).
// Math as gemm_wg.cu: T((q - z) * s) with one rounding, fp32 accumulation; split-K partials summed by
// awq_splitk_reduce_kernel (gemm_tc.cu). Groups of whole 64-k units only (G % 64 == 0 or one group).
#include "common.cuh"
#include "gemm_units.cuh"
#include "wgmma.cuh"

namespace awq_wb {
constexpr int PROD = 8;   // producer warps (consumer warps: the kernel's CW)
constexpr int BM = 64, XPITCH = 144;
constexpr int B_BYTES = 256 * 128, X_BYTES = BM * XPITCH, STAGE = B_BYTES + X_BYTES;   // 41 KB, 1 KB multiples
static_assert(STAGE % 1024 == 0, "stages keep the 1024-byte alignment of B");

AWQ_DEVICE void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
AWQ_DEVICE void ldsm_x4(u32 addr, u32 (&a)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr) : "memory");
}
AWQ_DEVICE void arrive(u32 bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
}  // namespace awq_wb

// MODE (timing probes, values wrong): 1 = the consumers only wait and release each stage (the producers' pace),
// 2 = the producers only bring x and arrive, without decoding (the consumers' pace).
// CW: consumer warps, 8 (two warpgroups of m64n128k16, 512 threads) or 4 (one warpgroup of m64n256k16, 384 threads:
// 168 registers for everyone instead of 128, v34).
template <typename T, int S, int D, bool XT = false, int MODE = 0, int CW = 8>
__global__ void __launch_bounds__(32 * (CW + awq_wb::PROD), 1) awq_gemm_wb_kernel(
    const T* __restrict__ x, const uint4* __restrict__ qtiles, const u32* __restrict__ scales,
    const u32* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ y, float* __restrict__ ws,
    int M, int N, int K, int NT16, int KS, int G, int NG, int Np, int units_per_split) {
  using namespace awq_wb;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full[S], empty[S];
  const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const u32 full0 = smem_addr(full), empty0 = smem_addr(empty);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int ub = blockIdx.y * units_per_split;
  const int n = min(KS, ub + units_per_split) - ub;
  const int blk0 = blockIdx.x * 16;
  pdl_trigger();
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, PROD + 1);   // one arrival per producer warp, one for the x bytes
      mbar_init(empty0 + 8 * s, CW);
    }
    mbar_init_fence();
  }
  static_assert(CW == 4 || CW == 8, "one or two consumer warpgroups");
  constexpr int NW = 1024 / CW;   // wgmma N (channels) per consumer warpgroup
  for (int i = tid; i < S * BM * 9; i += 32 * (CW + PROD)) {   // x rows >= M of every stage: zero, for good
    const int s = i / (BM * 9), rem = i - s * (BM * 9);
    if (rem / 9 >= M) sts128(base + s * STAGE + B_BYTES + rem * 16, 0u, 0u, 0u, 0u);
  }
  __syncthreads();

  if (warp >= CW) {   // ---------------- producers ----------------
    const int pw = warp - CW, c = lane & 7, r = lane >> 3;
    const int np2 = Np >> 1;
    const uint4* wsrc[2];
    bool ok[2];
    int szo[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int b = blk0 + pw + 8 * j;
      ok[j] = b < NT16;
      wsrc[j] = qtiles + ((long long)(ok[j] ? b : 0) * KS + ub) * 32 + 4 * c + r;
      szo[j] = 8 * (ok[j] ? b : 0) + c;
    }
    struct Stage { uint4 w[2]; u32 s[2], z[2]; };
    // Load cursor (units are loaded in order): the weights of both blocks, the scale/zero row of the next unit's
    // group (groups of whole 64-k units), and how many units of that group are left to load. Running values, so
    // that a load is 6 loads and a few adds (v34: the per-unit division by G and the index products are gone).
    const uint4* lw0 = wsrc[0];
    const uint4* lw1 = wsrc[1];
    const int upg = NG == 1 ? KS : G / 64;                      // units per scale group
    const int g0 = NG == 1 ? 0 : min((64 * ub) / G, NG - 1);
    int lrow = g0 * np2, lleft = NG == 1 ? KS : upg - (ub - g0 * upg);
    auto load = [&](Stage& q) {   // the next unit of this split
      q.w[0] = ok[0] ? __ldcs(lw0) : make_uint4(0u, 0u, 0u, 0u);
      q.w[1] = ok[1] ? __ldcs(lw1) : make_uint4(0u, 0u, 0u, 0u);
      q.s[0] = ok[0] ? __ldg(scales + lrow + szo[0]) : 0u;
      q.z[0] = ok[0] ? __ldg(zeros + lrow + szo[0]) : 0u;
      q.s[1] = ok[1] ? __ldg(scales + lrow + szo[1]) : 0u;
      q.z[1] = ok[1] ? __ldg(zeros + lrow + szo[1]) : 0u;
      lw0 += 32;
      lw1 += 32;
      if (--lleft == 0) {
        lleft = upg;
        lrow = min(lrow + np2, (NG - 1) * np2);
      }
    };
    // store offsets inside a stage: block j, channel c (cc = 0) or c + 8 (cc = 1), 16-byte chunk 4 h + r
    u32 soff[2][2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          soff[j][cc][h] = (u32)((16 * (pw + 8 * j) + c + 8 * cc) * 128 + (((4 * h + r) ^ c) << 4));
    // Weights in batches of B = D / 2 units, two batches of registers: the next batch is requested right after the
    // first unit of the current one is decoded, so that decode's wait (ptxas tracks all these loads on one
    // scoreboard) covers loads issued B units earlier and nothing newer (gemm_wg.cu, docs/history.md v20).
    constexpr int B = D / 2;
    static_assert(B >= 1, "two batches of at least one unit");
    Stage sb[2][B];
#pragma unroll
    for (int j = 0; j < B; ++j)
      if (j < n) load(sb[0][j]);
    pdl_wait();   // x may come from the previous kernel
    const int rows = min(M, BM);
    const T* xu = x + (long long)ub * (BM * XPITCH / 2);   // XT: unit 0's x image
    int s = 0;
    u32 round = 0;   // wraps of the stage ring so far
#pragma unroll 1
    for (int it = 0; it < n; it += 2 * B) {
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
#pragma unroll
        for (int jb = 0; jb < B; ++jb) {
          const int u = it + hb * B + jb;
          if (u >= n) break;
          const u32 sb0 = base + (u32)s * STAGE, fb = full0 + 8u * (u32)s;
          if (round > 0) mbar_wait(empty0 + 8u * (u32)s, (round - 1u) & 1u);
          if (XT) {        // x given as per-unit images [KS][64][72] (144-byte rows, zeros past M and K): one copy
            if (pw == 0 && lane == 0) bulk_load(sb0 + B_BYTES, xu, X_BYTES, fb);
            xu += BM * XPITCH / 2;
          } else if (pw == 0) {   // x rows of unit u: bulk copies (K % 8 == 0: whole 16-byte pieces), zeros past K
            const int k0 = 64 * (ub + u), kb = 2 * min(64, K - k0);
            if (lane == 0) mbar_expect(fb, (u32)(rows * kb));
            __syncwarp();
            for (int m = lane; m < rows; m += 32) {
              bulk_copy(sb0 + B_BYTES + m * XPITCH, x + (long long)m * K + k0, (u32)kb, fb);
              for (int q = kb; q < 128; q += 16) sts128(sb0 + B_BYTES + m * XPITCH + q, 0u, 0u, 0u, 0u);
            }
          }
          const Stage& st = sb[hb][jb];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            if (!ok[j] || MODE == 2) continue;   // its B rows stay as they are: their columns are never stored
            ScaledDecoder<T> dec;
            dec.set(st.z[j], st.s[j]);
            u32 a[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) dec.fragment(awq_units::word(st.w[j], i), a[i]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {   // words 2 h, 2 h + 1: k 32 h + 8 r .. + 7, chunk 4 h + r
              sts128(sb0 + soff[j][0][h], a[2 * h][0], a[2 * h][2], a[2 * h + 1][0], a[2 * h + 1][2]);
              sts128(sb0 + soff[j][1][h], a[2 * h][1], a[2 * h][3], a[2 * h + 1][1], a[2 * h + 1][3]);
            }
          }
          if (jb == 0)   // the next batch, now that this batch's loads have been waited for
#pragma unroll
            for (int jj = 0; jj < B; ++jj)
              if (u + B + jj < n) load(sb[hb ^ 1][jj]);
          // the stores, for the wgmmas (asynchronous proxy); the lanes meet, then lane 0 arrives for the warp
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          __syncwarp();
          if (lane == 0) arrive(fb);
          if (++s == S) {
            s = 0;
            ++round;
          }
        }
    }
    return;
  }

  // ---------------- consumers ----------------
  pdl_wait();
  const int wg = warp >> 2, wq = warp & 3, g8 = lane >> 2, t4 = lane & 3;
  float acc[NW / 2];
#pragma unroll
  for (int e = 0; e < NW / 2; ++e) acc[e] = 0.f;
  // A wgmma reads its A registers until it completes, which the compiler does not model: once a unit's wgmmas are
  // issued it may give their fragment registers to the next unit's ldmatrix. So each unit's group is waited for
  // (wait<0>) before the next unit's fragments are loaded, and its stage is released right there; the other
  // warpgroup's wgmmas keep the tensor cores busy meanwhile. v34: waiting for the previous unit's group only
  // (wait<1>, one unit in flight per warpgroup) let ptxas put the next unit's fragments into the registers of
  // wgmmas still running, without a warning, and outputs were wrong whenever the producers ran ahead (bench/
  // docs/history.md v34; tests/test_kernels.py checks the SASS of every wgmma kernel for such writes).
  u32 af[4][4];
  // ldmatrix.x4 rows: lanes 0-15 rows 16 wq + lane at k 0, lanes 16-31 the same rows at k 8
  const u32 xoff = (u32)(B_BYTES + (16 * wq + (lane & 15)) * XPITCH + (lane >> 4) * 16);
  const u32 desc0 = awq_wg::desc_lo(base + wg * (NW * 128));   // this warpgroup's NW B rows
#pragma unroll 1
  for (int u = 0; u < n; ++u) {
    const int s = u % S;
    mbar_wait(full0 + 8 * s, (u / S) & 1);
    const u32 sb = base + s * STAGE;
    if (MODE != 1) {
#pragma unroll
      for (int t = 0; t < 4; ++t) ldsm_x4(sb + xoff + 32 * t, af[t]);
      awq_wg::fence();
#pragma unroll
      for (int t = 0; t < 4; ++t)
        Wgmma<T, NW>::run(acc, af[t], awq_wg::desc_sw128(desc0 + s * (STAGE >> 4) + 2 * t));
    }
    awq_wg::commit();
    awq_wg::wait<0>();   // this unit's wgmmas are done: its stage and its fragment registers are free
    if (lane == 0) awq_wb::arrive(empty0 + 8 * s);
  }
  awq_wg::wait<0>();
  // acc[4 j + e]: token 16 wq + g8 + 8 (e >> 1), channel 256 blockIdx.x + NW wg + 8 j + 2 t4 + (e & 1)
  const bool split = gridDim.y > 1;
#pragma unroll
  for (int j = 0; j < NW / 8; ++j) {
    const int ch = 256 * blockIdx.x + NW * wg + 8 * j + 2 * t4;
    if (ch >= N) continue;   // N % 8 == 0: ch + 1 < N too
    const float b0 = (!split && bias != nullptr) ? Traits<T>::to_float(bias[ch]) : 0.f;
    const float b1 = (!split && bias != nullptr) ? Traits<T>::to_float(bias[ch + 1]) : 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = 16 * wq + g8 + 8 * h;
      if (tok >= M) continue;
      const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      if (split)
        *reinterpret_cast<float2*>(ws + ((long long)blockIdx.y * M + tok) * Np + ch) = make_float2(v0, v1);
      else
        *reinterpret_cast<u32*>(y + (long long)tok * N + ch) = pack2<T>(v0 + b0, v1 + b1);
    }
  }
}
