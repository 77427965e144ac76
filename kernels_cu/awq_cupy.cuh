// awq_cupy.cuh: the device-side contract of a QuantizedWeight, for kernels of one's own.
//
// Include this header ("awq_cupy.cuh") in a source compiled by awq_cupy.jit.compile_source / compile_file (the
// library's own kernels include it too, so it cannot drift from what they read). docs/kernel-api.md is the long form; the host
// side of every argument is QuantizedWeight.layout() (awq_cupy.weight.WeightLayout).
//
// The weight W [K, N] (y = x @ W), W[k, n] = (Q[k, n] - Z[g, n]) * S[g, n] with g = k / G, is stored as
//   qtiles  uint4 [NT16][KS][32]   NT16 = Np / 16 column blocks, KS = Kp / 64 k blocks (Np, Kp: N, K rounded up
//                                  to 64). Block (t, ks) covers columns 16t .. 16t+15 and k 64ks .. 64ks+63 in
//                                  512 contiguous bytes, one uint4 per lane; a column block's whole K is contiguous.
//   scales  T [NG][Np]             per group, each 16-column block permuted: position 2c + h holds column c + 8h,
//                                  so lane column c reads the pair (c, c + 8) as one 32-bit word. Padding is 0.
//   zeros   T [NG][Np]             same permutation, holding MAGIC + z (1024 + z in fp16, 128 + z in bf16).
// Lane l of a warp (r = l % 4, c = l / 4) holds, in word i (0..3) of its uint4 of block (t, ks), eight 4-bit
// codes: value v (0..7) sits in nibble slot {0,4,1,5,2,6,3,7}[v] and is
//   Q[64 ks + awq_tile_k(i, r) + 2 ((v >> 1) & 1) + (v & 1),  16 t + c + 8 (v >> 2)]
// i.e. columns c (v < 4) and c + 8 (v >= 4), four consecutive k each. Word i is exactly the lane's A fragment
// source of mma.m16n8k16 k-step i with the weights as the 16-row operand (WeightDecoder below), and the matching
// B fragment (x^T, 8 tokens) is x[token][64 ks + 32 (i >> 1) + 8 r .. + 7] (awq_load_x8). A 32-k half never
// straddles a group: the library requires G % 32 == 0 or G == K. Codes outside K x N are 0.
//
// From common.cuh (included here), part of the same contract:
//   Traits<T>, pack2<T>(a, b)                      T = __half or __nv_bfloat16 and its pair type
//   WeightDecoder<T>: set_zeros(zero pair word), a_fragment(word, u32 a[4])
//                       exact (q - z) A fragment {a0..a3} of one word (16 channels x 16 k), fp32-exact
//   int4pair_magic<T>(w), dequant_pair<T>(qmagic, z2, s2)
//                       slots 0 and 4 of w as (MAGIC + q) pairs; (q - z) * s rounded once per half
//   mma_16816<T>(float c[4], const u32 a[4], b0, b1)   D += A * B, fp32 accumulate (sm_75: two k8 steps)
//   pdl_wait(), pdl_trigger()                        programmatic dependent launch (no-ops without the feature)
//   ld_act16(p)                                      coherent 16-byte load for activations (safe under PDL)
#pragma once
#include "common.cuh"

// The first k, inside a 64-k block, of pair f = 0 of word i for lane r; pair f = 1 starts 2 further.
AWQ_DEVICE int awq_tile_k(int i, int r) { return layout_k(i, r); }

// Lane `lane`'s 16 bytes of block (t, ks): its four words, one per mma k-step.
AWQ_DEVICE uint4 awq_load_tile(const uint4* __restrict__ qtiles, int KS, int t, int ks, int lane) {
  return __ldg(qtiles + ((long long)t * KS + ks) * 32 + lane);
}

// Code of value v (0..7) of a tile word (see the layout above); for scalar kernels.
AWQ_DEVICE u32 awq_code(u32 word, int v) { return (word >> (4 * ((v & 1) * 4 + (v >> 1)))) & 0xFu; }

// Group of the k range starting at k0 (clamped for the K padding of the last block).
AWQ_DEVICE int awq_group(int k0, int G, int NG) { return min(k0 / G, NG - 1); }

// Element offset in scales / zeros of column block t in group g; lane column c's pair is at + 2c.
AWQ_DEVICE long long awq_group_offset(int Np, int g, int t) { return (long long)g * Np + 16 * t; }

// The 32-bit pair (column 16t + c in the low half, 16t + c + 8 in the high half) of scales or zeros of group g.
template <typename T> AWQ_DEVICE u32 awq_load_pair(const T* __restrict__ rows, int Np, int g, int t, int c) {
  return __ldg(reinterpret_cast<const u32*>(rows + awq_group_offset(Np, g, t) + 2 * c));
}

// x[64 ks + 32 h + 8 r .. + 7] of one row of K activations as a uint4 (zeros at and beyond K; K % 8 == 0), read
// coherently (ld_act16). Its .x/.y are b0/b1 of word 2h, .z/.w those of word 2h + 1.
template <typename T> AWQ_DEVICE uint4 awq_load_x8(const T* xrow, int K, int ks, int h, int r) {
  const int k = 64 * ks + 32 * h + 8 * r;
  return k < K ? ld_act16(xrow + k) : make_uint4(0u, 0u, 0u, 0u);
}
