// timing.cu: the benchmark's spin kernel (awq_cupy/bench.py, bench_decode.py), not used by matmul.
//
// awq_spin_kernel keeps one thread busy for `ns` nanoseconds of %globaltimer time. The benchmark enqueues it
// first, then the start event, the timed calls and the end event: while the GPU spins, the host fills the
// queue, so the timed calls run back to back with no Python launch gaps (docs/benchmarking.md).
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
