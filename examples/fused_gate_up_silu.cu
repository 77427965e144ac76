// y[n] = silu(x . W[:, n]) * (x . W[:, I + n]) for n < I = N / 2: a decoder MLP's gate/up GEMV at M = 1 with
// its activation in the epilogue, on a fused gate_up QuantizedWeight (columns [0, I) gate, [I, 2I) up).
// Compiled by examples/fused_gate_up_silu.py through awq_cupy.jit.compile_file; the layout, the decoder and
// the mma come from awq_cupy.cuh (docs/kernel-api.md).
//
// One CTA of 4 warps per 16-column block t of gate and its partner block t + I/16 of up; x is staged in shared
// memory once, the warps split the 64-k blocks into four contiguous runs and load each step's weights while the
// previous step's are multiplied (the first step's before waiting for x: programmatic dependent launch). Per k
// block: the exact (q - z) fragments times x in one mma per k16 step (fp32 sums; x is the 8-token operand, token
// 0 real, the others zero), then the block's sums times the group's scales (G % 64 == 0 or one group, so a k
// block lies in one group). Partial sums meet in shared memory.
#include "awq_cupy.cuh"

constexpr int U = 2;   // k blocks per step; the next step's weights are loaded while this one's are multiplied

template <typename T> struct Step {   // one step's weights: U k blocks x (gate, up), with their zero/scale pairs
  uint4 w[U][2];
  u32 z[U][2], s[U][2];
  AWQ_DEVICE void load(const uint4* qtiles, const T* scales, const T* zeros, int KS, int Np, int G, int NG,
                       int t0, int I16, int ks0, int kend, int lane, int c) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ks = min(ks0 + u, kend - 1), g = awq_group(64 * ks, G, NG);
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        w[u][p] = awq_load_tile(qtiles, KS, t0 + p * I16, ks, lane);
        z[u][p] = awq_load_pair(zeros, Np, g, t0 + p * I16, c);
        s[u][p] = awq_load_pair(scales, Np, g, t0 + p * I16, c);
      }
    }
  }
};

template <typename T>
__global__ void __launch_bounds__(128) gate_up_silu_gemv(
    const uint4* __restrict__ qtiles, const T* __restrict__ scales, const T* __restrict__ zeros,
    int K, int N, int KS, int Np, int G, int NG, const T* x, T* __restrict__ y) {
  extern __shared__ uint4 xs[];                    // x as 8-value chunks, KS * 8 of them, zeros past K
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane & 3, c = lane >> 2;
  const int I16 = N / 32, per = (KS + 3) / 4, kbeg = warp * per, kend = min(KS, kbeg + per);
  float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};     // [gate, up][column c, c + 8] of token 0 (lanes r == 0)
  Step<T> next;
  if (kbeg < kend) next.load(qtiles, scales, zeros, KS, Np, G, NG, blockIdx.x, I16, kbeg, kend, lane, c);
  pdl_wait();                                      // the weights are in flight; x may be the previous output
  for (int j = threadIdx.x; j < KS * 8; j += 128) xs[j] = 8 * j < K ? ld_act16(x + 8 * j) : make_uint4(0, 0, 0, 0);
  __syncthreads();
  for (int ks0 = kbeg; ks0 < kend; ks0 += U) {
    const Step<T> cur = next;
    if (ks0 + U < kend) next.load(qtiles, scales, zeros, KS, Np, G, NG, blockIdx.x, I16, ks0 + U, kend, lane, c);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ks0 + u >= kend) break;
      const uint4 zero = make_uint4(0, 0, 0, 0);   // x is token 0 of the mma's 8: lanes 0..3 carry it
      const uint4 x0 = lane < 4 ? xs[8 * (ks0 + u) + r] : zero, x1 = lane < 4 ? xs[8 * (ks0 + u) + 4 + r] : zero;
      const u32 b[4][2] = {{x0.x, x0.y}, {x0.z, x0.w}, {x1.x, x1.y}, {x1.z, x1.w}};
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const u32 words[4] = {cur.w[u][p].x, cur.w[u][p].y, cur.w[u][p].z, cur.w[u][p].w};
        WeightDecoder<T> dec;
        dec.set_zeros(cur.z[u][p]);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          u32 a[4];
          dec.a_fragment(words[i], a);
          mma_16816<T>(d, a, b[i][0], b[i][1]);
        }
        const typename Traits<T>::T2 s = *reinterpret_cast<const typename Traits<T>::T2*>(&cur.s[u][p]);
        acc[p][0] += d[0] * Traits<T>::to_float(s.x);   // channel c, token 0
        acc[p][1] += d[2] * Traits<T>::to_float(s.y);   // channel c + 8, token 0
      }
    }
  }
  pdl_trigger();
  __shared__ float part[4][2][16];
  if (r == 0) {
#pragma unroll
    for (int p = 0; p < 2; ++p) { part[warp][p][c] = acc[p][0]; part[warp][p][c + 8] = acc[p][1]; }
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int j = threadIdx.x, n = 16 * blockIdx.x + j;
    const float gate = part[0][0][j] + part[1][0][j] + part[2][0][j] + part[3][0][j];
    const float up = part[0][1][j] + part[1][1][j] + part[2][1][j] + part[3][1][j];
    if (n < N / 2) y[n] = Traits<T>::from_float(gate / (1.f + __expf(-gate)) * up);
  }
}
