// bench_util.cu: helpers for honest timing (awq_cupy/bench.py), not used by the library's hot path.
//
// awq_spin_kernel keeps one thread busy for `ns` nanoseconds of %globaltimer time. The benchmark enqueues it
// first, then the start event, the timed calls and the end event: while the GPU spins, the host fills the
// queue, so the timed calls run back to back with no Python launch gaps (gpu-notes.md §6).
#include "common.cuh"

__global__ void awq_spin_kernel(long long ns) {  // ns: how long to spin
  u64 start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
#if AWQ_CUPY_CC >= 700
    __nanosleep(1000);
#endif
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while ((long long)(now - start) < ns);
}

// Flushes L2 by streaming through a buffer larger than it (used when weights cannot be rotated).
__global__ void awq_touch_kernel(const uint4* __restrict__ buf, long long n16, unsigned* __restrict__ sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = buf[i];
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1;  // practically never: keeps the loads alive
}
