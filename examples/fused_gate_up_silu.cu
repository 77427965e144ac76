// y[n] = silu(x . W[:, n]) * (x . W[:, I + n]) for n < I = N / 2: a decoder MLP's gate/up GEMV at M = 1 with
// its activation in the epilogue, on a fused gate_up QuantizedWeight (columns [0, I) gate, [I, 2I) up).
// Compiled by examples/fused_gate_up_silu.py through awq_cupy.jit.compile_file; the layout, the decoder and
// the mma come from awq_cupy.cuh (docs/kernel-api.md).
//
// One CTA of 4 warps per 16-column block t of gate and its partner block t + I/16 of up; the warps split the
// 64-k blocks (ks = warp, warp + 4, ...). Per k block: the exact (q - z) fragments times x in one mma per k16
// step (fp32 sums; x is the 8-token operand, token 0 real, the others zero), then the block's sums times the
// group's scales (G % 64 == 0 or one group, so a k block lies in one group). Partial sums meet in shared memory.
#include "awq_cupy.cuh"

template <typename T>
__global__ void __launch_bounds__(128) gate_up_silu_gemv(
    const uint4* __restrict__ qtiles, const T* __restrict__ scales, const T* __restrict__ zeros,
    int K, int N, int KS, int Np, int G, int NG, const T* x, T* __restrict__ y) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane & 3, c = lane >> 2;
  const int I = N / 2;
  float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};     // [gate, up][column c, c + 8] of token 0 (lanes r == 0)
  pdl_wait();                                      // x may be the previous kernel's output
  for (int ks = warp; ks < KS; ks += 4) {
    const int g = awq_group(64 * ks, G, NG);
    const uint4 x0 = lane < 4 ? awq_load_x8(x, K, ks, 0, r) : make_uint4(0u, 0u, 0u, 0u);
    const uint4 x1 = lane < 4 ? awq_load_x8(x, K, ks, 1, r) : make_uint4(0u, 0u, 0u, 0u);
    const u32 b[4][2] = {{x0.x, x0.y}, {x0.z, x0.w}, {x1.x, x1.y}, {x1.z, x1.w}};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int t = blockIdx.x + p * (I / 16);     // gate block, then its up block
      const uint4 wv = awq_load_tile(qtiles, KS, t, ks, lane);
      const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
      WeightDecoder<T> dec;
      dec.set_zeros(awq_load_pair(zeros, Np, g, t, c));
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 a[4];
        dec.a_fragment(words[i], a);
        mma_16816<T>(d, a, b[i][0], b[i][1]);
      }
      const u32 s2 = awq_load_pair(scales, Np, g, t, c);
      const typename Traits<T>::T2 s = *reinterpret_cast<const typename Traits<T>::T2*>(&s2);
      acc[p][0] += d[0] * Traits<T>::to_float(s.x);   // channel c, token 0
      acc[p][1] += d[2] * Traits<T>::to_float(s.y);   // channel c + 8, token 0
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
    if (n < I) y[n] = Traits<T>::from_float(gate / (1.f + __expf(-gate)) * up);
  }
}
