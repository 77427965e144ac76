// wgmma_probes.cu: sm_90a probes of bench/probes (compiled by bench/probes/runtime.py, not part of the wheel).
//
// awq_wgmma_probe_kernel: the warpgroup-MMA rate with A from registers, m64nNk16 fp16 -> fp32, NACC independent
// accumulators per warpgroup, one commit group per round and one group left in flight (wait_group 1), B a zeroed
// 128-byte-swizzled tile in shared memory. bench/probes/wgmma_probe.py compares small N (the GEMV's 8 or 16 tokens) with
// mma.sync (awq_mma_probe_kernel in probes.cu).
#include "common.cuh"
#include "wgmma.cuh"
#include "gemm_units.cuh"

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

// awq_wgmma_sts_probe_kernel (bench/probes/wgmma_sts_probe.py): does a warpgroup's wgmma with B from shared memory keep
// its rate while other warps of the CTA store into shared memory at full speed, and how fast do those warps decode
// beside it (the budget of a kernel whose producer warps decode weights into a wgmma operand tile)?
// - Warps 0-3: m64nNk16, A from registers, B an N x 128-byte swizzled tile, four k16 steps per round, one group
//   left in flight; warp 0's lane 0 records its clock64 cycles. MMA false: they only wait as long as the wgmmas
//   would take at full rate.
// - Warps 4..4 + PW - 1, until the consumers are done: per 16 bytes, a 16-byte shared store into a separate 32 KB
//   region (lanes on consecutive chunks) of an independent word as is (DECODE 0), after the GEMM's scaled decode
//   (1: ScaledDecoder, 13 instructions), after 13 integer LOP3 (2) or after 13 half2 multiplies (3). Each producer
//   warp's lane 0 adds its stores.
// - counts[3 * blockIdx.x + 0..2] = consumer cycles, producer stores (warp-wide 16-byte stores summed over the
//   warps), producer cycles of warp 4.
// At 512 threads the launch bound caps every thread at 128 registers, too few for m64n256's accumulators (ptxas
// allocates the whole kernel to that bound, setmaxnreg notwithstanding), so PW = 12 runs with N = 64 only.
template <int N, int PW, int DECODE, bool MMA = true>
__global__ void __launch_bounds__(128 + 32 * PW, 1)
    awq_wgmma_sts_probe_kernel(float* __restrict__ sink, unsigned long long* __restrict__ counts, int iters) {
  extern __shared__ unsigned char sts_smem_raw[];
  __shared__ int done;
  __shared__ unsigned long long stores;
  const u32 base = (smem_addr(sts_smem_raw) + 1023u) & ~1023u;
  const u32 region = base + N * 128;
  for (u32 i = threadIdx.x; i < N * 32; i += blockDim.x)
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(base + 4 * i), "r"(0u) : "memory");
  if (threadIdx.x == 0) { done = 0; stores = 0ull; }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp < 4) {
    const u32 v = 0x3c003c00u ^ (threadIdx.x & 7);
    const u32 a[4] = {v, v ^ 1u, v ^ 2u, v ^ 3u};
    const u64 desc = awq_wg::desc_sw128(awq_wg::desc_lo(base));
    float acc[N / 2];
#pragma unroll
    for (int e = 0; e < N / 2; ++e) acc[e] = 0.f;
    const long long t0 = clock64();
    if (MMA) {
      for (int it = 0; it < iters; ++it) {
        awq_wg::fence();
#pragma unroll
        for (int t = 0; t < 4; ++t) Wgmma<__half, N>::run(acc, a, desc + 2 * t);
        awq_wg::commit();
        awq_wg::wait<1>();
      }
    } else {   // as long as the wgmmas would take at full rate, without them
      while (clock64() - t0 < (long long)iters * 4 * (N / 2)) {
      }
    }
    awq_wg::wait<0>();
    const long long t1 = clock64();
    if (threadIdx.x == 0) {
      counts[3 * blockIdx.x] = (unsigned long long)(t1 - t0);
      *(volatile int*)&done = 1;
    }
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < N / 2; ++e) s += acc[e];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  } else {
    const int pw = warp - 4;
    ScaledDecoder<__half> dec;
    dec.set(0x00080008u ^ lane, 0x2c002c00u);
    u32 w = 0x76543210u * (threadIdx.x + 1);
    unsigned long long n = 0;
    const long long t0 = clock64();
    while (*(volatile int*)&done == 0) {
#pragma unroll 4
      for (int j = 0; j < 64; ++j) {
        u32 a[4];
        const u32 wj = w ^ (0x01030507u * (u32)(j + 1));   // independent words, as if loaded
        if (DECODE == 1) {
          dec.fragment(wj, a);
        } else if (DECODE == 2) {   // the same count of integer operations (13 LOP3)
          a[0] = lop3<0xea>(wj, 0x000f000fu, 0x64006400u);
          a[1] = lop3<0xea>(wj >> 8, 0x000f000fu, 0x64006400u);
          a[2] = lop3<0xea>(wj, 0x00f000f0u, 0x64006400u);
          a[3] = lop3<0xea>(wj >> 8, 0x00f000f0u, 0x64006400u);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            a[0] = lop3<0x96>(a[0], a[1], 0x5a5a5a5au);
            a[1] = lop3<0x96>(a[1], a[2], 0x3c3c3c3cu);
            a[2] = lop3<0x96>(a[2], a[3], 0x0f0f0f0fu);
            a[3] = lop3<0x96>(a[3], a[0], 0x33333333u);
          }
        } else if (DECODE == 3) {   // the same count of half2 operations (13 HFMA2)
          a[0] = hmul2_bits<__half>(wj, 0x3c003c00u);
          a[1] = hmul2_bits<__half>(wj ^ 0x00ff00ffu, 0x3c003c00u);
          a[2] = hmul2_bits<__half>(wj ^ 0x0f0f0f0fu, 0x3c003c00u);
          a[3] = hmul2_bits<__half>(wj ^ 0x33333333u, 0x3c003c00u);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            a[0] = hmul2_bits<__half>(a[0], a[1]);
            a[1] = hmul2_bits<__half>(a[1], a[2]);
            a[2] = hmul2_bits<__half>(a[2], a[3]);
            a[3] = hmul2_bits<__half>(a[3], a[0]);
          }
        } else {
          a[0] = wj; a[1] = wj + 1u; a[2] = wj + 2u; a[3] = wj + 3u;
        }
        const u32 addr = region + ((((u32)n * 64u + (u32)j) * (PW * 32) + pw * 32 + lane) & 2047u) * 16u;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                     "r"(a[3]) : "memory");
      }
      ++n;
      w += 0x9e3779b9u;
    }
    const long long t1 = clock64();
    if (lane == 0) {
      atomicAdd(&stores, n * 64ull);
      if (pw == 0) counts[3 * blockIdx.x + 2] = (unsigned long long)(t1 - t0);
    }
    if (lane == 0) sink[blockIdx.x * blockDim.x + threadIdx.x] = (float)(w & 0xffu);
  }
  __syncthreads();
  if (threadIdx.x == 0) counts[3 * blockIdx.x + 1] = stores;
}
