// bench_wg.cu: sm_90a probes for bench/ (not used by the library's hot path).
//
// awq_wgmma_probe_kernel: the warpgroup-MMA rate with A from registers, m64nNk16 fp16 -> fp32, NACC independent
// accumulators per warpgroup, one commit group per round and one group left in flight (wait_group 1), B a zeroed
// 128-byte-swizzled tile in shared memory. bench/wgmma_probe.py compares small N (the GEMV's 8 or 16 tokens) with
// mma.sync (awq_mma_probe_kernel in bench_util.cu).
#include "common.cuh"
#include "wgmma.cuh"

template <int N, int NACC>
__global__ void __launch_bounds__(512, 1) awq_wgmma_probe_kernel(float* __restrict__ sink, int iters) {
  __shared__ __align__(1024) unsigned char btile[N * 128];
  for (int i = threadIdx.x; i < N * 32; i += blockDim.x) reinterpret_cast<u32*>(btile)[i] = 0u;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const u32 v = 0x3c003c00u ^ (threadIdx.x & 7);
  const u32 a[4] = {v, v ^ 1u, v ^ 2u, v ^ 3u};
  const u64 desc = awq_wg::desc_sw128(awq_wg::desc_lo(smem_addr(btile)));
  float acc[NACC][N / 2];
#pragma unroll
  for (int j = 0; j < NACC; ++j)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) acc[j][e] = 0.f;
  for (int it = 0; it < iters; ++it) {
    awq_wg::fence();
#pragma unroll
    for (int j = 0; j < NACC; ++j) Wgmma<__half, N>::run(acc[j], a, desc + 2 * (j & 3));
    awq_wg::commit();
    awq_wg::wait<1>();
  }
  awq_wg::wait<0>();
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NACC; ++j)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) s += acc[j][e];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
