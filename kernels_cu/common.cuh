// common.cuh: device helpers shared by every awq_cupy kernel.
//
// Scalar/vector type traits for the two activation dtypes (fp16, bf16), the int4 -> fp16/bf16 conversions,
// and thin inline-PTX wrappers (lop3, cp.async, ldmatrix, mma.sync). Included (inlined by awq_cupy.jit, so
// header edits change the compile-cache key) by the kernel files in this folder. Self-contained: only
// cuda_fp16.h and cuda_bf16.h.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef AWQ_CUPY_CC
#define AWQ_CUPY_CC 750
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
