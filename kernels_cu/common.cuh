// common.cuh: device helpers shared by every awq_cupy kernel.
//
// Scalar/vector type traits for the two activation dtypes (fp16, bf16), the int4 -> fp16/bf16 conversions,
// and thin inline-PTX wrappers (lop3, cp.async, ld.shared.v4, mma.sync). Included (inlined by awq_cupy.jit, so
// header edits change the compile-cache key) by the kernel files in this folder. Self-contained: only
// cuda_fp16.h and cuda_bf16.h.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// AWQ_CUPY_CC = 10 x compute capability of the compile target (like __CUDA_ARCH__), set by awq_cupy.jit; used
// here only where an instruction exists from some architecture on. What the library decides per architecture
// (bf16 mma, PDL, the GEMV's bounds) comes from the target's feature row, awq_cupy.jit.Arch, as AWQ_ARCH_<NAME>
// defines, so that the kernels and the planners read the same flags.
#ifndef AWQ_CUPY_CC
#define AWQ_CUPY_CC 750
#endif
#if !defined(AWQ_ARCH_MMA_K16) || !defined(AWQ_ARCH_PDL) || !defined(AWQ_ARCH_GEMV_MID_WARPS) || \
    !defined(AWQ_ARCH_GEMV_SCALED_16_WARPS)
#error "compile through awq_cupy.jit: it defines the target's AWQ_ARCH_* features"
#endif

#define AWQ_DEVICE __device__ __forceinline__

// ------------------------------------------------------------------------------------------------------------
// Type traits: one 16-bit element type T and its packed pair T2.
// ------------------------------------------------------------------------------------------------------------
template <typename T> struct Traits;
template <> struct Traits<__half> {
  typedef __half2 T2;
  static AWQ_DEVICE float to_float(__half v) { return __half2float(v); }
  static AWQ_DEVICE __half from_float(float v) { return __float2half_rn(v); }
  static AWQ_DEVICE __half2 from_float2(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Traits<__nv_bfloat16> {
  typedef __nv_bfloat162 T2;
  static AWQ_DEVICE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static AWQ_DEVICE __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static AWQ_DEVICE __nv_bfloat162 from_float2(float a, float b) {
    __nv_bfloat162 r; r.x = __float2bfloat16_rn(a); r.y = __float2bfloat16_rn(b); return r;
  }
};

// Two 16-bit values packed in one u32 (low half = first element), from floats, with one rounding each.
template <typename T> AWQ_DEVICE u32 pack2(float a, float b) {
  typename Traits<T>::T2 v = Traits<T>::from_float2(a, b);
  return *reinterpret_cast<u32*>(&v);
}

// ------------------------------------------------------------------------------------------------------------
// AutoAWQ "gemm" packing: logical column j of an 8-column word sits in nibble slot REV[j] (ORDER = [0,2,4,6,1,
// 3,5,7] is the inverse). The shift of logical column j is therefore 4*REV[j] = {0,16,4,20,8,24,12,28}[j].
// ------------------------------------------------------------------------------------------------------------
AWQ_DEVICE u32 awq_gemm_nibble(u32 word, int j) {
  const int shift = ((j & 1) << 4) | ((j >> 1) << 2);   // j=2i -> 4i, j=2i+1 -> 16+4i
  return (word >> shift) & 0xFu;
}

// lop3.b32 d = f(a, b, c) for an arbitrary 3-input truth table (PTX ISA "lop3").
template <int LUT> AWQ_DEVICE u32 lop3(u32 a, u32 b, u32 c) {
  u32 d;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}

// ------------------------------------------------------------------------------------------------------------
// int4 -> 16-bit float pairs by FasterTransformer's "magic number" trick (docs/formats.md §Magic-number conversion):
// (x & 0x000f000f) | MAGIC puts nibble slots 0 and 4 into the low mantissa bits of two 16-bit floats whose
// exponent makes one mantissa ulp equal 1. fp16 MAGIC 0x6400 = 1024.0, bf16 MAGIC 0x4300 = 128.0, so each half
// becomes MAGIC + q exactly. Subtracting a pre-transformed zero (MAGIC + z) gives q - z exactly.
// lop3 LUT 0xea = (a & b) | c for the canonical inputs a = 0xf0, b = 0xcc, c = 0xaa.
// ------------------------------------------------------------------------------------------------------------
template <typename T> struct Magic;
template <> struct Magic<__half> { static constexpr u32 pair = 0x64006400u; static constexpr float value = 1024.f; };
template <> struct Magic<__nv_bfloat16> { static constexpr u32 pair = 0x43004300u; static constexpr float value = 128.f; };

template <typename T> AWQ_DEVICE u32 int4pair_magic(u32 w) {  // slots 0 and 4 of w -> (MAGIC+q0, MAGIC+q4)
  return lop3<0xea>(w, 0x000f000fu, Magic<T>::pair);
}

// q - z on a packed pair (exact: both are MAGIC + small integer).
template <typename T> AWQ_DEVICE u32 hsub2_bits(u32 qmagic, u32 zmagic2);
template <> AWQ_DEVICE u32 hsub2_bits<__half>(u32 q, u32 z) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&q), *reinterpret_cast<__half2*>(&z));
  return *reinterpret_cast<u32*>(&r);
}
template <> AWQ_DEVICE u32 hsub2_bits<__nv_bfloat16>(u32 q, u32 z) {
#if AWQ_ARCH_MMA_K16
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&q), *reinterpret_cast<__nv_bfloat162*>(&z));
  return *reinterpret_cast<u32*>(&r);
#else
  return 0u;  // bf16 kernels are not instantiated below sm_80 (no bf16 mma there)
#endif
}

// Product of packed pairs, rounded once per half.
template <typename T> AWQ_DEVICE u32 hmul2_bits(u32 a, u32 b);
template <> AWQ_DEVICE u32 hmul2_bits<__half>(u32 a, u32 b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<u32*>(&r);
}
template <> AWQ_DEVICE u32 hmul2_bits<__nv_bfloat16>(u32 a, u32 b) {
#if AWQ_ARCH_MMA_K16
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<u32*>(&r);
#else
  return 0u;
#endif
}

// (q - z) * s on a packed pair, in T arithmetic: the subtraction is exact, the product rounds once.
template <typename T> AWQ_DEVICE u32 dequant_pair(u32 qmagic, u32 zmagic2, u32 s2) {
  return hmul2_bits<T>(hsub2_bits<T>(qmagic, zmagic2), s2);
}

// floor(n / d) for 0 <= n < 2^31 as (n * m) >> s, with fd = m | s << 32 from the host (awq_cupy.plans.fastdiv:
// s = 31 + ceil(log2 d), m = ceil(2^s / d) < 2^32; exact for every such n by Granlund and Montgomery's bound).
AWQ_DEVICE u32 fastdiv(u32 n, u64 fd) { return (u32)(((u64)n * (u32)fd) >> (u32)(fd >> 32)); }

// Broadcast the low / high 16-bit half of a word into both halves.
AWQ_DEVICE u32 bcast_lo(u32 v) { return __byte_perm(v, v, 0x1010); }
AWQ_DEVICE u32 bcast_hi(u32 v) { return __byte_perm(v, v, 0x3232); }

// The k order of the tile layout (awq_cupy/layout.py, k_of_kappa): the first k, inside its 64-k block, of pair
// f = 0 of word i for lane r (lane % 4); pair f = 1 starts 2 further, each pair holds two consecutive k.
AWQ_DEVICE int layout_k(int i, int r) { return 32 * (i >> 1) + 8 * r + 4 * (i & 1); }

// ------------------------------------------------------------------------------------------------------------
// One tile-layout word -> the exact (q - z) A fragment {a0, a1, a2, a3} of the swapped-operand GEMV (slots
// (0,4), (2,6), (1,5), (3,7); awq_cupy/layout.py), for one 16-column block whose zero word holds MAGIC + z of
// channels c (low half) and c + 8 (high half).
// fp16 takes one shift per word: slots 1, 5 (and 3, 7 after the shift) are converted in place with mask
// 0x00f000f0, which gives 1024 + 16q; one fma by 1/16 and -(64 + z) makes q - z exactly (FasterTransformer /
// Marlin's trick). bf16 (7 mantissa bits: the in-place form does not fit) shifts each nibble pair down.
// ------------------------------------------------------------------------------------------------------------
template <typename T> struct WeightDecoder;
template <> struct WeightDecoder<__half> {
  u32 zlo, zhi, nz64lo, nz64hi;   // (1024 + z) pairs and -(64 + z) pairs of channels c and c + 8
  AWQ_DEVICE void set_zeros(u32 zw) {
    zlo = bcast_lo(zw);
    zhi = bcast_hi(zw);
    const __half2 k960 = __float2half2_rn(960.f);   // 960 - (1024 + z) = -(64 + z), exact
    __half2 a = __hsub2(k960, *reinterpret_cast<__half2*>(&zlo));
    __half2 b = __hsub2(k960, *reinterpret_cast<__half2*>(&zhi));
    nz64lo = *reinterpret_cast<u32*>(&a);
    nz64hi = *reinterpret_cast<u32*>(&b);
  }
  AWQ_DEVICE void a_fragment(u32 w, u32 (&a)[4]) const {
    const u32 w8 = w >> 8;
    const __half2 sixteenth = __float2half2_rn(0.0625f);
    a[0] = hsub2_bits<__half>(lop3<0xea>(w, 0x000f000fu, 0x64006400u), zlo);
    a[1] = hsub2_bits<__half>(lop3<0xea>(w8, 0x000f000fu, 0x64006400u), zhi);
    const u32 h2 = lop3<0xea>(w, 0x00f000f0u, 0x64006400u), h3 = lop3<0xea>(w8, 0x00f000f0u, 0x64006400u);
    __half2 r2 = __hfma2(*reinterpret_cast<const __half2*>(&h2), sixteenth, *reinterpret_cast<const __half2*>(&nz64lo));
    __half2 r3 = __hfma2(*reinterpret_cast<const __half2*>(&h3), sixteenth, *reinterpret_cast<const __half2*>(&nz64hi));
    a[2] = *reinterpret_cast<u32*>(&r2);
    a[3] = *reinterpret_cast<u32*>(&r3);
  }
};
template <> struct WeightDecoder<__nv_bfloat16> {
  u32 zlo, zhi;
  AWQ_DEVICE void set_zeros(u32 zw) { zlo = bcast_lo(zw); zhi = bcast_hi(zw); }
  AWQ_DEVICE void a_fragment(u32 w, u32 (&a)[4]) const {
    a[0] = hsub2_bits<__nv_bfloat16>(int4pair_magic<__nv_bfloat16>(w), zlo);
    a[1] = hsub2_bits<__nv_bfloat16>(int4pair_magic<__nv_bfloat16>(w >> 8), zhi);
    a[2] = hsub2_bits<__nv_bfloat16>(int4pair_magic<__nv_bfloat16>(w >> 4), zlo);
    a[3] = hsub2_bits<__nv_bfloat16>(int4pair_magic<__nv_bfloat16>(w >> 12), zhi);
  }
};

// ------------------------------------------------------------------------------------------------------------
// Shared-memory movement. cp.async (sm_80+) with zero fill: src-size 0 writes 16 zero bytes without reading
// global memory, which is how tails (rows >= M, k >= K) are masked. On sm_75 a synchronous copy stands in.
// ------------------------------------------------------------------------------------------------------------
AWQ_DEVICE u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

AWQ_DEVICE void cp_async16(void* dst, const void* src, bool pred) {
#if AWQ_ARCH_MMA_K16
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
#else
  *reinterpret_cast<uint4*>(dst) = pred ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// Weights are streamed exactly once: keep them from evicting the activations, which every CTA re-reads from L2.
AWQ_DEVICE u64 evict_first_policy() {
  u64 p = 0;
#if AWQ_ARCH_MMA_K16
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
#endif
  return p;
}
AWQ_DEVICE void cp_async16_stream(void* dst, const void* src, bool pred, u64 policy) {
#if AWQ_ARCH_MMA_K16
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(pred ? 16 : 0), "l"(policy));
#else
  cp_async16(dst, src, pred);
#endif
}
AWQ_DEVICE void cp_async_commit() {
#if AWQ_ARCH_MMA_K16
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> AWQ_DEVICE void cp_async_wait() {
#if AWQ_ARCH_MMA_K16
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ------------------------------------------------------------------------------------------------------------
// Bulk copies (sm_90, PTX "cp.async.bulk") counted on mbarriers: one thread announces the bytes of a phase
// (arrive.expect_tx) and issues the copies; readers wait for the phase's parity. Used by the wgmma GEMM (its
// x tiles).
// ------------------------------------------------------------------------------------------------------------
#if AWQ_CUPY_CC >= 900
AWQ_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the asynchronous proxy (the bulk copies' completions).
AWQ_DEVICE void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The phase of bar expects `bytes` more bytes; this is its (single) arrival.
AWQ_DEVICE void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst, counted on bar.
AWQ_DEVICE void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// One phase of a barrier with a single arrival: expect `bytes`, then copy them.
AWQ_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  mbar_expect(bar, bytes);
  bulk_copy(dst, src, bytes, bar);
}
// A 2-D tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned) passed by value as a __grid_constant__ kernel
// parameter; awq_cupy.driver.TensorMap encodes it on the host (cuTensorMapEncodeTiled).
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};
// The box of `map` at (element c0 of a row, row c1) to shared dst, counted on bar; elements outside the tensor are
// written as zeros and counted too, so a phase expects the whole box's bytes.
AWQ_DEVICE void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
AWQ_DEVICE void tma_prefetch(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// One arrival on bar (release: this thread's earlier writes are visible to whoever waits for the phase).
AWQ_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Until the barrier's phase with this parity has completed.
AWQ_DEVICE void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "AWQ_MBAR_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra AWQ_MBAR_WAIT_%=;\n"
      "}\n" ::"r"(bar), "r"(parity) : "memory");
}
#endif

// ------------------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90, PTX "griddepcontrol"). awq_cupy launches its kernels on sm_90 with the
// programmatic-stream-serialization attribute (awq_cupy.driver.Launch, as matmul launches), so a kernel may start
// while the previous kernel of the stream is finishing, once every CTA of that kernel has called pdl_trigger().
// Such a kernel reads only the weights (written long before, never by these kernels) until it calls pdl_wait(),
// which returns once the previous kernel has completed and its writes are visible; it reads x and workspaces and
// writes anything only after that. Without the attribute (other GPUs, other launchers) both are no-ops.
// ------------------------------------------------------------------------------------------------------------
AWQ_DEVICE void pdl_wait() {
#if AWQ_ARCH_PDL
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
AWQ_DEVICE void pdl_trigger() {
#if AWQ_ARCH_PDL
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Activations (x, x tiles: anything the previous kernel of the stream may write) are read with coherent loads,
// never ld.global.nc (__ldg): the non-coherent path assumes data that nothing writes while the kernel runs, which
// programmatic dependent launch breaks, and ptxas then may (and in one GEMV build did) move such a load above
// griddepcontrol.wait (docs/design.md §Rounding and correctness). volatile keeps NVVM from moving them across
// pdl_wait() as well. Through L1.
AWQ_DEVICE uint4 ld_act16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
AWQ_DEVICE u32 ld_act4(const void* p) {
  u32 v;
  asm volatile("ld.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// One 16-byte shared-memory load at a shared-window byte address (16-byte aligned; spelled out because the
// compiler cannot see the alignment of a computed address and would split it into four 4-byte loads).
AWQ_DEVICE uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
AWQ_DEVICE uint4 lds128(const void* p) { return lds128(smem_addr(p)); }

// ------------------------------------------------------------------------------------------------------------
// D += A(16x16, row) * B(16x8, col), fp32 accumulate. Fragments as in the PTX ISA "mma.m16n8k16" figures:
// a[0..3] = A rows (g, g+8) x k (2t.., 2t+8..), b[0..1] = B k (2t, 2t+1), (2t+8, 2t+9) at column g,
// c[0..3] = rows (g, g, g+8, g+8) x columns (2t, 2t+1, 2t, 2t+1), with g = lane / 4 and t = lane % 4.
// sm_75 has only m16n8k8 (fp16): one k16 step is two k8 steps with (a0, a1; b0) and (a2, a3; b1).
// ------------------------------------------------------------------------------------------------------------
template <typename T> AWQ_DEVICE void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> AWQ_DEVICE void mma_16816<__half>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if AWQ_ARCH_MMA_K16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}
template <> AWQ_DEVICE void mma_16816<__nv_bfloat16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if AWQ_ARCH_MMA_K16
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

