// probes.cu: kernels of the bench/probes scripts (compiled by bench/probes/runtime.py, not part of the wheel):
// the L2 flush, the GEMV memory-pipeline and load probes, the mma.sync rate probe, the launch-floor kernels.
#include "common.cuh"

// Flushes L2 by streaming through a buffer larger than it (used when weights cannot be rotated).
__global__ void awq_touch_kernel(const uint4* __restrict__ buf, long long n16, unsigned* __restrict__ sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = buf[i];
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1;  // practically never: keeps the loads alive
}

// cp.async.wait_group with a run-time count (the instruction takes an immediate): a uniform switch (the probe's
// depth is a measurement parameter).
AWQ_DEVICE void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    case 8: cp_async_wait<8>(); break;
    case 9: cp_async_wait<9>(); break;
    case 10: cp_async_wait<10>(); break;
    case 11: cp_async_wait<11>(); break;
    case 12: cp_async_wait<12>(); break;
    case 13: cp_async_wait<13>(); break;
    default: cp_async_wait<14>(); break;
  }
}

// Memory-pipeline probe (bench/probes/stream_probe.py): the GEMV's streaming structure without its math. Each warp of
// a grid of one CTA per SM streams `units` units of `tw` 512-byte pieces through a `depth`-slot cp.async ring
// in shared memory and XORs what it reads. A warp owns tw * units * 512 contiguous bytes; `strided` = 0 reads
// them in order (a unit's pieces adjacent), 1 as tw parallel streams (piece i of unit u at i * units + u, like
// the blocks of a GEMV column group). Shows what bandwidth the ring structure reaches before any decoding.
__global__ void __launch_bounds__(1024, 1) awq_stream_probe_kernel(
    const uint4* __restrict__ src, int units, int tw, int strided, int depth, unsigned* __restrict__ sink) {
  extern __shared__ __align__(16) unsigned char smem_probe[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const long long gw = (long long)blockIdx.x * W + warp;
  unsigned char* ring = smem_probe + (long long)warp * depth * tw * 512;
  const uint4* p = src + gw * (long long)units * tw * 32 + lane;   // this warp's bytes
  int issued = 0;
  auto issue = [&](int slot) {
    if (issued < units) {
      for (int i = 0; i < tw; ++i)
        cp_async16(ring + (slot * tw + i) * 512 + 16 * lane,
                   p + 32 * (strided ? (long long)i * units + issued : (long long)issued * tw + i), true);
      ++issued;
    }
    cp_async_commit();
  };
  for (int s = 0; s < depth - 1; ++s) issue(s);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int u = 0; u < units; ++u) {
    cp_async_wait_dyn(depth - 2);
    __syncwarp();
    const int slot = u % depth;
    issue((u + depth - 1) % depth);
    for (int i = 0; i < tw; ++i) {
      const uint4 v = lds128(ring + (slot * tw + i) * 512 + 16 * lane);
      acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
  }
  cp_async_wait<0>();
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1;
}

// The same bytes read with plain 16-byte loads into registers (U loads of consecutive 512-byte units in flight per
// warp), for comparison with the cp.async ring above.
template <int U>
__global__ void __launch_bounds__(1024, 1) awq_ldg_probe_kernel(const uint4* __restrict__ src, int units,
                                                                unsigned* __restrict__ sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const long long gw = (long long)blockIdx.x * W + warp;
  const uint4* p = src + gw * (long long)units * 32 + lane;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int u = 0; u + U <= units; u += U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = __ldcs(p + (long long)(u + j) * 32);
#pragma unroll
    for (int j = 0; j < U; ++j) { acc.x ^= v[j].x; acc.y ^= v[j].y; acc.z ^= v[j].z; acc.w ^= v[j].w; }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1;
}

// Tensor-pipe probe: each warp issues `iters` x NACC independent fp16 mma.m16n8k16 with fp32 accumulation on
// register operands (no memory traffic), to measure the mma.sync rate the GEMM kernels can reach per SM.
template <int NACC>
__global__ void __launch_bounds__(1024, 1) awq_mma_probe_kernel(float* __restrict__ sink, int iters) {
  const u32 v = 0x3c003c00u ^ (threadIdx.x & 7);   // ~1.0 in fp16, varied per lane
  u32 a[4] = {v, v ^ 1u, v ^ 2u, v ^ 3u};
  const u32 b0 = v ^ 4u, b1 = v ^ 5u;
  float acc[NACC][4];
#pragma unroll
  for (int j = 0; j < NACC; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int j = 0; j < NACC; ++j) mma_16816<__half>(acc[j], a, b0, b1);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NACC; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Launch-floor probe (bench/probes/launch_floor.py): a kernel that only does what every awq_cupy kernel does on sm_90
// around its work (trigger the dependent launch, wait for the previous grid). Timed back to back, it gives the
// per-call floor of the benchmark's method; the dynamic shared memory decides how many CTAs share an SM, so that a
// large request keeps the next kernel's CTAs off an SM until this one's leave it (as the GEMV's registers do).
__global__ void awq_empty_kernel(unsigned* __restrict__ sink, int flag) {
  pdl_trigger();
  pdl_wait();
  if (flag == 0x7fffffff && threadIdx.x == 0) sink[blockIdx.x] = 1u;   // never: the launch is all there is
}

// Pure-read probe with the GEMV's launch pattern: CTA b streams its contiguous share of n16 16-byte words with
// the streaming hint, U loads per thread in flight, requested before pdl_wait() (like the GEMV's first weights;
// here every load is, which only a kernel that writes nothing before the wait may do).
template <int U>
__global__ void __launch_bounds__(512, 1) awq_read_pdl_kernel(const uint4* __restrict__ src, long long n16,
                                                              unsigned* __restrict__ sink) {
  pdl_trigger();
  const long long b0 = (long long)blockIdx.x * n16 / gridDim.x, b1 = (long long)(blockIdx.x + 1) * n16 / gridDim.x;
  const int T = blockDim.x;
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
  long long i = b0 + threadIdx.x;
  for (; i + (long long)(U - 1) * T < b1; i += (long long)U * T) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = __ldcs(src + i + (long long)j * T);
#pragma unroll
    for (int j = 0; j < U; ++j) { acc.x ^= v[j].x; acc.y ^= v[j].y; acc.z ^= v[j].z; acc.w ^= v[j].w; }
  }
  for (; i < b1; i += T) {
    const uint4 v = __ldcs(src + i);
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  pdl_wait();
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1u;
}

// Code-size probe (bench/probes/launch_floor.py): 16 N fp32 FMAs in straight-line code (no loop, no memory traffic),
// so that the time of a back-to-back call shows how fast a kernel's first pass through its code runs (the
// instruction cache is cold at each launch if it grows with the code rather than with the issue rate).
template <int N>
__global__ void awq_code_probe_kernel(float* __restrict__ sink, float seed) {
  pdl_trigger();
  float a[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) a[j] = seed + j + threadIdx.x;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 16; ++j) a[j] = fmaf(a[j], 1.0001f, (float)(i ^ j));
  pdl_wait();
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) s += a[j];
  if (s == 1234.5f) sink[threadIdx.x] = s;   // practically never: keeps the arithmetic alive
}
