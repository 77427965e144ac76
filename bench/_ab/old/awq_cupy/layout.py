"""awq_cupy's own weight layout, chosen for the tensor-core kernels (reference implementation, numpy or cupy).

A ``QuantizedWeight`` holds, for ``W[k, n] = (Q[k, n] - Z[g, n]) * S[g, n]`` with ``g = k // G``:

* ``qtiles`` uint32 ``[NT16, KS, 32, 4]`` with ``NT16 = Np / 16``, ``KS = Kp / 64`` and ``Np``, ``Kp`` = N, K rounded
  up to multiples of 64 (``TILE_N`` and ``K_ALIGN``). Block ``(t, ks)`` covers ``n in [16 t, 16 t + 16)`` and
  ``k in [64 ks, 64 ks + 64)`` in 512 contiguous bytes; lane ``l`` of a warp loads its 16 bytes
  ``qtiles[t, ks, l]``, and word ``i`` of them is the operand of the block's mma k16 step ``i``. With
  ``r = l % 4``, ``c = l // 4``, word ``i`` holds 8 codes, value ``v`` in nibble slot ``REV[v]``::

      Q[64 ks + 32 (i >> 1) + 8 r + 4 (i & 1) + 2 ((v >> 1) & 1) + (v & 1),  16 t + c + 8 (v >> 2)]

  The fp16/bf16 "magic number" conversion of ``(w, w >> 8, w >> 4, w >> 12)`` yields the lane's
  ``mma.m16n8k16`` A fragment of the 16 channels (the weights are the 16-row operand, x^T the 8-token one), for
  the mma k index ``kappa = 16 (i & 1) + 8 f + 2 r + e`` of the 32-k half ``i >> 1`` standing for the real
  ``k = 8 r + 4 (i & 1) + 2 f + e`` (``f = (v >> 1) & 1``, ``e = v & 1``). The mma only needs x^T in the same
  order (``k_of_kappa``): then lane ``(g, r)``'s x^T fragments of a 32-k half are the 8 consecutive values
  ``x[token g, 32 h + 8 r .. + 7]``, one 16-byte load (the GEMV), and a half never straddles a group (G % 32 ==
  0). Blocks are stored column-block major: one 16-column block's whole K is contiguous, so a warp streams any
  run of (block, k) units from one linear range. Codes outside ``K x N`` are 0: the kernels zero-fill ``x`` for
  ``k >= K`` and drop columns ``>= N``.
* ``scales`` ``[NG, Np]`` in the activation dtype, each 16-column block permuted so position ``2c + h`` holds
  column ``c + 8h`` (lane ``c`` then reads the two fragment columns of a block, ``c`` and ``c + 8``, as one
  32-bit word, and a block's 16 scales are 32 contiguous bytes); padded columns 0.
* ``zeros`` ``[NG, Np]``, same permutation, holding ``MAGIC + Z`` as a 16-bit float (1024 + z in fp16,
  128 + z in bf16; bit pattern ``MAGIC_BITS | z``). Subtracting it from the converted code gives ``q - z``
  exactly; one multiply by the scale then rounds once.

Everything here is plain array code for tests and documentation; the GPU repack kernel (kernels_cu/repack.cu)
produces ``qtiles`` without materialising ``Q``.
"""
from __future__ import annotations

import numpy as np

from ._array import get_xp

TILE_K = 16
TILE_N = 64
K_ALIGN = 64            # k per pipeline stage of the GEMM: K is padded to it
MAGIC_BITS = {"float16": 0x6400, "bfloat16": 0x4300}   # 1024.0 in fp16, 128.0 in bf16: one ulp == 1
REV = np.array([0, 4, 1, 5, 2, 6, 3, 7])               # value v -> nibble slot


def k_of_kappa(kappa):
    """The real k (0..63) inside a 64-k block of the mma k index ``kappa = 16 i + 8 f + 2 r + e`` (word i, pair f
    of lane r, element e): ``32 (i >> 1) + 8 r + 4 (i & 1) + 2 f + e``. x^T enters every mma in this order."""
    i, f, r, e = kappa >> 4, (kappa >> 3) & 1, (kappa >> 1) & 3, kappa & 1
    return 32 * (i >> 1) + 8 * r + 4 * (i & 1) + 2 * f + e


def padded_sizes(K: int, N: int) -> tuple[int, int]:
    """(Kp, Np): K rounded up to K_ALIGN, N rounded up to TILE_N."""
    return -(-K // K_ALIGN) * K_ALIGN, -(-N // TILE_N) * TILE_N


def pack_tiles(Q):
    """Logical codes ``Q`` uint8 [K, N] -> ``qtiles`` uint32 [NT16, KS, 32, 4] (reference for the repack kernel)."""
    xp = get_xp(Q)
    K, N = Q.shape
    Kp, Np = padded_sizes(K, N)
    Qp = xp.zeros((Kp, Np), dtype=xp.uint32)
    Qp[:K, :N] = Q
    KS, NT16 = Kp // K_ALIGN, Np // 16
    # k = 64 ks + 32 hh + 8 r + 4 i2 + 2 f + e (word i = 2 hh + i2); n = 16 t + 8 h + c; lane = 4 c + r;
    # value v = 4 h + 2 f + e
    T = Qp.reshape(KS, 2, 4, 2, 2, 2, NT16, 2, 8)                 # ks, hh, r, i2, f, e, t, h, c
    V = T.transpose(6, 0, 8, 2, 1, 3, 7, 4, 5).reshape(NT16, KS, 32, 4, 8)
    words = xp.zeros((NT16, KS, 32, 4), dtype=xp.uint32)
    for v in range(8):
        words |= V[..., v] << xp.uint32(4 * int(REV[v]))
    return words


def unpack_tiles(qtiles, K: int, N: int):
    """Inverse of ``pack_tiles``: uint32 [NT16, KS, 32, 4] -> uint8 [K, N]."""
    xp = get_xp(qtiles)
    NT16, KS = qtiles.shape[:2]
    shifts = xp.asarray((4 * REV).astype(np.uint32))
    V = (qtiles[..., None] >> shifts) & xp.uint32(0xF)                 # t, ks, lane, i, v
    V = V.reshape(NT16, KS, 8, 4, 2, 2, 2, 2, 2)                        # t, ks, c, r, hh, i2, h, f, e
    Qp = V.transpose(1, 4, 3, 5, 7, 8, 0, 6, 2).reshape(KS * K_ALIGN, NT16 * 16)
    return Qp[:K, :N].astype(xp.uint8)


def permute_columns(A, Np: int):
    """[NG, N] -> [NG, Np]: zero-pad to Np, then in each 16-column block put column c + 8h at position 2c + h."""
    xp = get_xp(A)
    NG, N = A.shape
    P = xp.zeros((NG, Np), dtype=A.dtype)
    P[:, :N] = A
    return xp.ascontiguousarray(P.reshape(NG, Np // 16, 2, 8).transpose(0, 1, 3, 2).reshape(NG, Np))


def unpermute_columns(P, N: int):
    xp = get_xp(P)
    NG, Np = P.shape
    return xp.ascontiguousarray(P.reshape(NG, Np // 16, 8, 2).transpose(0, 1, 3, 2).reshape(NG, Np)[:, :N])


def float_bits(S32, dtype: str):
    """float32 array -> uint16 bit patterns of ``dtype`` (float16, or bfloat16 with round-to-nearest-even)."""
    xp = get_xp(S32)
    S32 = S32.astype(xp.float32)
    if dtype == "float16":
        return S32.astype(xp.float16).view(xp.uint16)
    u = S32.view(xp.uint32)
    return ((u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)).astype(xp.uint16)


def zero_bits(Z, dtype: str):
    """Codes Z (0..15) -> uint16 bit patterns of MAGIC + z in ``dtype``."""
    xp = get_xp(Z)
    return Z.astype(xp.uint16) | xp.uint16(MAGIC_BITS[dtype])
