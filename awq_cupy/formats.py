"""AWQ on-disk layouts: pack, unpack, detect and convert (numpy or CuPy arrays; docs/formats.md).

Logical convention
------------------
Every AWQ format stores the same grouped, asymmetric 4-bit weight; this module moves between that logical
form and the four packed layouts::

    Q  uint8    [K, N]       4-bit codes, values 0..15
    Z  uint8    [K/G, N]     zero points, values 0..15 (all 8 for the symmetric ``marlin`` format)
    S  float16  [K/G, N]     scales
    W[k, n] = (Q[k, n] - Z[k // G, n]) * S[k // G, n]

``K`` = in_features, ``N`` = out_features, ``G`` = group size (a config value of -1 means one group, G = K),
``NG = K // G``. ``W`` is ``nn.Linear.weight.T`` ([K, N]), so a layer computes ``y = x @ W + bias``.

Formats (``FORMATS``)
---------------------
=========== ===================================== ================================ ==========================
format      qweight                               zeros                            scales
=========== ===================================== ================================ ==========================
gemm        int32 [K, N/8], along N, AWQ ORDER    qzeros int32 [NG, N/8] (same)    fp16 [NG, N]
gemv        int32 [N, K/8], along K, sequential   qzeros int32 [N, ZW], padded     fp16 [N, 8·ZW], padded
gemv_fast   int16 [N/4, K], 4-row interleave      qzeros/scaled_zeros [8·ZW, N]    [8·ZW, N], padded rows 0
                                                  = -(S·Z) as a float, padded
marlin      int32 [K/16, 2N], Marlin tiles        none (symmetric, Z = 8)          fp16 [NG, N], permuted
=========== ===================================== ================================ ==========================

``ZW = zeros_width(K, G)`` (docs/formats.md §Group sizes). ``bias`` (fp16 [N]) is the same in every format and
is not touched by ``pack``/``unpack``; the converters pass it through.

Dtype rules
-----------
* Packed words (``qweight``/``qzeros`` of gemm, gemv, marlin) are int32 on disk but only bit containers: int32
  and uint32 are both accepted and always read as unsigned (docs/formats.md §Conventions). ``pack`` returns
  int32 (int16 for the gemv_fast ``qweight``), like AutoAWQ writes them.
* Float tensors (scales, gemv_fast zeros) may be float16, float32, ``ml_dtypes.bfloat16`` (numpy only) or
  **uint16, which is read as bfloat16 bit patterns** (``safetensors.numpy`` cannot return bf16 tensors, so
  llm-awq's bf16 checkpoints arrive that way). ``unpack`` returns S as float16 and raises when a value is not
  exactly representable in float16 instead of rounding it silently.
* Every function takes its array module from its inputs (``get_xp``): numpy in, numpy out; CuPy in, CuPy out.

Group sizes and detection
-------------------------
``resolve_group_size`` accepts -1, K, or any multiple of 8 that divides K (enough for ``gemm``); gemv and
gemv_fast additionally need G >= 128 or G in {32, 64} (their padded zero width, ``zeros_width``), gemv_fast
needs K % 64 == 0 and marlin K % 16 == 0 and N % 64 == 0; every format needs N % 8 == 0.
``detect_format`` (K and N known) and ``infer_shape`` (only the tensors) read the format from qweight's dtype
and the shapes of qweight, zeros and scales (docs/formats.md §Detection); the scales shape separates gemm from
gemv, square layers included. Neither trusts a config's ``version`` tag.

All public functions validate their inputs and raise ``TypeError`` (wrong dtype), ``ValueError`` (a shape or
value rule) or ``FormatError`` (a ``ValueError``: packed tensors that match no format or disagree with each
other), each naming the offending value and the rule.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ._array import get_xp, is_bfloat16

__all__ = [
    "FORMATS",
    "ORDER",
    "REV",
    "SCALE_PERM",
    "SINGLE_PERM",
    "FormatError",
    "LayerShape",
    "resolve_group_size",
    "zeros_width",
    "packed_shapes",
    "validate_logical",
    "pack",
    "unpack",
    "unpack_scaled_zeros",
    "detect_format",
    "infer_shape",
    "to_gemm",
    "convert",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
]

FORMATS = ("gemm", "gemv", "gemv_fast", "marlin")

# "AWQ order" (docs/formats.md §The gemm layout): nibble slot i of a gemm word holds logical element ORDER[i].
# The lop3 int4->fp16 conversion emits a word's slots in the order (0,4),(1,5),(2,6),(3,7); storing element j
# in slot REV[j] makes that output come out as elements 0..7 in order.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REV = tuple(int(i) for i in np.argsort(ORDER))  # (0, 4, 1, 5, 2, 6, 3, 7): element j lives in slot REV[j]
_SEQ = tuple(range(8))                           # gemv: element i in slot i

# Marlin scale permutations (docs/formats.md §The marlin layout). Grouped scales: an 8x8 transpose of every
# 64-column chunk, so lane c = lane // 4 reads its fragment columns c + 8m as 8 consecutive halves. Per-channel
# scales (G = K) follow the mma accumulator layout instead, because Marlin applies them at write-out; 32-column
# chunks.
SCALE_PERM = tuple(i + 8 * j for i in range(8) for j in range(8))
SINGLE_PERM = tuple(2 * i + d for i in range(4) for d in (0, 1, 8, 9, 16, 17, 24, 25))
_SCALE_PERM_INV = tuple(int(i) for i in np.argsort(SCALE_PERM))
_SINGLE_PERM_INV = tuple(int(i) for i in np.argsort(SINGLE_PERM))

_MAX_CODE = 15            # unsigned 4-bit codes 0..15
_MARLIN_ZERO = 8          # AutoAWQ marlin stores q_signed + 8: an implicit zero point of 8
_GF_ZERO_KEYS = ("qzeros", "scaled_zeros")   # AutoAWQ vs llm-awq name of the gemv_fast zero tensor

_WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))
_HALFWORD_DTYPES = (np.dtype(np.int16), np.dtype(np.uint16))


class FormatError(ValueError):
    """Packed tensors that match no AWQ format, or whose tensors disagree with each other."""


class LayerShape(NamedTuple):
    """What ``infer_shape`` finds: the format and the layer's K (in_features) and N (out_features)."""

    fmt: str
    in_features: int
    out_features: int


# --------------------------------------------------------------------------------------------------------------
# Scalars: group size, zero width, expected shapes
# --------------------------------------------------------------------------------------------------------------

def _as_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _positive_int(value, name: str) -> int:
    v = _as_int(value, name)
    if v <= 0:
        raise ValueError(f"{name}={v} must be positive")
    return v


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_fmt(fmt) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a string, one of {FORMATS}, got {fmt!r}")
    f = fmt.lower()   # checkpoints write "GEMM" as often as "gemm" (docs/formats.md §Checkpoint pitfalls)
    if f not in FORMATS:
        raise ValueError(f"unknown AWQ format {fmt!r}; supported formats are {FORMATS}")
    return f


def resolve_group_size(group_size, K) -> int:
    """The group size G > 0 for ``K`` input features; ``-1`` (one group) resolves to ``K``.

    Accepted: -1, K itself, or any G > 0 that divides K and is a multiple of 8. That is the general rule of the
    ``gemm`` layout (and of the masked kernels); a 32-k block then never straddles two groups for the usual
    sizes 32/64/128. Per-format limits (``gemv``/``gemv_fast`` need G >= 128 or G in {32, 64}; see
    ``zeros_width``) are checked by ``pack``/``unpack``.
    """
    K = _positive_int(K, "K")
    G = _as_int(group_size, "group_size")
    if G == -1:
        return K
    if G <= 0:
        raise ValueError(f"group_size={G} must be positive, or -1 for one group spanning K")
    if K % G:
        raise ValueError(f"K={K} is not a multiple of group_size={G}")
    if G != K and G % 8:
        raise ValueError(f"group_size={G} must be a multiple of 8 (or -1, or equal to K={K})")
    return G


def zeros_width(K, G) -> int:
    """Number of int32 zero words per output row of gemv/gemv_fast, which pad to it (docs/formats.md §Group sizes).

    Groups are packed 8 per word, and the width is rounded up to a multiple of 2 (G = 64) or 4 (G = 32) so the
    reference GEMV kernel's 1024-wide k-blocks align. Those layouts define no other G below 128, so any other
    G < 128 raises ``ValueError``. ``G = -1`` means one group (ZW = 1). Examples: (4096, 128) -> 4,
    (11008, 128) -> 11, (13824, 128) -> 14, (11008, 64) -> 22.
    """
    G = resolve_group_size(G, K)
    if G >= 128:
        mult = 1
    elif G == 64:
        mult = 2
    elif G == 32:
        mult = 4
    else:
        raise ValueError(f"group_size={G} is not supported by the gemv/gemv_fast zero and scale layout "
                         "(it needs group_size >= 128, or 64, or 32)")
    words = _ceil_div(int(K) // G, 8)
    return _ceil_div(words, mult) * mult


def _check_layer(fmt: str, K, N, group_size) -> int:
    """Validate a layer shape for ``fmt``; returns the resolved G. ``fmt`` must already be normalised."""
    K = _positive_int(K, "K (in_features)")
    N = _positive_int(N, "N (out_features)")
    G = resolve_group_size(group_size, K)
    if N % 8:
        raise ValueError(f"N={N} (out_features) is not a multiple of 8, which every AWQ layout requires")
    if fmt == "gemv":
        if K % 8:
            raise ValueError(f"K={K} is not a multiple of 8, which gemv needs (8 k values per int32 word)")
        zeros_width(K, G)
    elif fmt == "gemv_fast":
        if K % 64:
            raise ValueError(f"K={K} is not a multiple of 64, which gemv_fast needs (64-wide K chunks)")
        zeros_width(K, G)
    elif fmt == "marlin":
        if K % 16:
            raise ValueError(f"K={K} is not a multiple of 16, which marlin needs (16x64 tiles)")
        if N % 64:
            raise ValueError(f"N={N} is not a multiple of 64, which marlin needs (16x64 tiles)")
    return G


def packed_shapes(fmt, in_features, out_features, group_size) -> dict:
    """Shapes of the packed tensors of ``fmt`` for a K x N layer, ``{name: shape}`` (bias not included).

    The gemv_fast zero tensor is listed as ``qzeros`` (AutoAWQ's name; llm-awq calls it ``scaled_zeros``).
    Raises ``ValueError`` when the layer shape or group size is not valid for ``fmt``.
    """
    fmt = _check_fmt(fmt)
    G = _check_layer(fmt, in_features, out_features, group_size)
    K, N = int(in_features), int(out_features)
    NG = K // G
    if fmt == "gemm":
        return {"qweight": (K, N // 8), "qzeros": (NG, N // 8), "scales": (NG, N)}
    if fmt == "gemv":
        ZW = zeros_width(K, G)
        return {"qweight": (N, K // 8), "qzeros": (N, ZW), "scales": (N, 8 * ZW)}
    if fmt == "gemv_fast":
        ZW = zeros_width(K, G)
        return {"qweight": (N // 4, K), "qzeros": (8 * ZW, N), "scales": (8 * ZW, N)}
    return {"qweight": (K // 16, 2 * N), "scales": (NG, N)}


# --------------------------------------------------------------------------------------------------------------
# Dtype helpers
# --------------------------------------------------------------------------------------------------------------

def bf16_bits_to_float32(bits):
    """float32 values of bfloat16 bit patterns (uint16 or int16 array, numpy or CuPy). Exact.

    bfloat16 is the top half of a float32, so shifting the 16 bits into the high half gives the same number.
    """
    xp = get_xp(bits)
    bits = xp.asarray(bits)
    if np.dtype(bits.dtype) not in _HALFWORD_DTYPES:
        raise TypeError(f"bfloat16 bit patterns must be uint16 (or int16), got {bits.dtype}")
    u = xp.ascontiguousarray(bits).view(xp.uint16).astype(xp.uint32)
    return (u << xp.uint32(16)).view(xp.float32)


def float32_to_bf16_bits(x):
    """bfloat16 bit patterns (uint16) of ``x``, rounded to nearest even like torch's ``.to(bfloat16)``.

    NaN maps to the canonical quiet NaN 0x7FC0; values beyond the bf16 range round to +-inf.
    """
    xp = get_xp(x)
    x = xp.asarray(x)
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"x must be a floating-point array, got {x.dtype}")
    u = xp.ascontiguousarray(x.astype(xp.float32)).view(xp.uint32)
    # Round to nearest even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit, then truncate.
    rounded = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)
    return xp.where(xp.isnan(x), xp.uint32(0x7FC0), rounded).astype(xp.uint16)


def _float_kind(a, name: str) -> str:
    """Storage kind of a float tensor: 'f16', 'f32' or 'bf16' (ml_dtypes or uint16 bits); TypeError else."""
    dt = np.dtype(a.dtype)
    if dt == np.float16:
        return "f16"
    if dt == np.float32:
        return "f32"
    if dt == np.uint16 or is_bfloat16(dt):
        return "bf16"
    raise TypeError(f"{name} must be float16, bfloat16 (ml_dtypes, or uint16 bit patterns) or float32, "
                    f"got {a.dtype}")


def _to_float32(xp, a, name: str):
    """float32 copy of a float tensor of any accepted storage kind (exact)."""
    _float_kind(a, name)   # dtype check
    if np.dtype(a.dtype) == np.uint16:
        return bf16_bits_to_float32(a)
    return a.astype(xp.float32)


def _round_as(xp, x32, kind: str):
    """``x32`` (float32) rounded once to the storage kind, returned as float32."""
    if kind == "f16":
        return x32.astype(xp.float16).astype(xp.float32)
    if kind == "bf16":
        return bf16_bits_to_float32(float32_to_bf16_bits(x32))
    return x32


def _first_index(xp, mask):
    """Index tuple of the first True element of a non-empty boolean mask with at least one True."""
    flat = int(xp.argmax(mask.ravel()))
    return tuple(int(i) for i in np.unravel_index(flat, mask.shape))


def _to_float16_exact(xp, a, name: str):
    """float16 copy of a float tensor; ValueError if any value would change (no silent rounding)."""
    if np.dtype(a.dtype) == np.float16:
        return a.copy()
    x32 = _to_float32(xp, a, name)
    with np.errstate(over="ignore"):   # an overflow to inf is reported below, with its index
        h = x32.astype(xp.float16)
    lost = (h.astype(xp.float32) != x32) & ~xp.isnan(x32)
    if bool(lost.any()):
        idx = _first_index(xp, lost)
        raise ValueError(f"{name} value {float(x32[idx])!r} at index {idx} is not exactly representable in "
                         "float16 (the logical S is float16); dequantize the packed tensors directly instead")
    return h


def _word_view(xp, a, name: str, dtypes=_WORD_DTYPES):
    """Unsigned view of packed words (int32/uint32 -> uint32, int16/uint16 -> uint16); TypeError else."""
    if np.dtype(a.dtype) not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must hold packed 4-bit values as {want}, got {a.dtype}")
    unsigned = xp.uint32 if dtypes[0].itemsize == 4 else xp.uint16
    return xp.ascontiguousarray(a).view(unsigned)


# --------------------------------------------------------------------------------------------------------------
# Logical tensors
# --------------------------------------------------------------------------------------------------------------

def _check_codes(xp, a, name: str) -> None:
    """Integer dtype and values 0..15."""
    kind = np.dtype(a.dtype).kind
    if kind not in "iu":
        raise TypeError(f"{name} must be an integer array of 4-bit values 0..15, got dtype {a.dtype}")
    bad = (a < 0) | (a > _MAX_CODE)
    if bool(bad.any()):
        idx = _first_index(xp, bad)
        raise ValueError(f"{name} must hold unsigned 4-bit values 0..{_MAX_CODE}; found {int(a[idx])} at index "
                         f"{idx} (min {int(a.min())}, max {int(a.max())})")


def _check_logical(Q, Z, S, group_size, *, z_optional: bool = False):
    """Validate logical (Q, Z, S); returns (xp, Q, Z, S, K, N, G) with arrays on the inputs' module."""
    xp = get_xp(Q, Z, S)
    Q = xp.asarray(Q)
    S = xp.asarray(S)
    if Z is None:
        if not z_optional:
            raise ValueError("Z is required (only the symmetric marlin format may omit it)")
    else:
        Z = xp.asarray(Z)
    if Q.ndim != 2:
        raise ValueError(f"Q must be 2-D [K, N], got shape {Q.shape}")
    K, N = (int(d) for d in Q.shape)
    if K == 0 or N == 0:
        raise ValueError(f"Q must be non-empty, got shape {Q.shape}")
    G = resolve_group_size(group_size, K)
    if N % 8:
        raise ValueError(f"N={N} (out_features, Q.shape[1]) is not a multiple of 8, which every AWQ layout "
                         "requires")
    expected = (K // G, N)
    if S.ndim != 2 or tuple(S.shape) != expected:
        raise ValueError(f"S has shape {tuple(S.shape)}, expected [K/G, N] = {expected} for Q of shape "
                         f"{(K, N)} and group_size={G}")
    if Z is not None and (Z.ndim != 2 or tuple(Z.shape) != expected):
        raise ValueError(f"Z has shape {tuple(Z.shape)}, expected [K/G, N] = {expected} for Q of shape "
                         f"{(K, N)} and group_size={G}")
    if np.dtype(S.dtype).kind != "f" and not is_bfloat16(S.dtype):
        raise TypeError(f"S must be a floating-point array (float16 scales), got dtype {S.dtype}")
    _check_codes(xp, Q, "Q")
    if Z is not None:
        _check_codes(xp, Z, "Z")
    return xp, Q, Z, S, K, N, G


def validate_logical(Q, Z, S, group_size) -> tuple:
    """Check logical ``(Q, Z, S)`` against the module convention; returns ``(K, N, G)``.

    Rules: Q integer [K, N] and Z integer [K/G, N], both with values 0..15; S floating [K/G, N]; K % G == 0;
    N % 8 == 0. ``group_size`` -1 means G = K.
    """
    _, _, _, _, K, N, G = _check_logical(Q, Z, S, group_size)
    return K, N, G


# --------------------------------------------------------------------------------------------------------------
# Nibble packing primitives (vectorised; the only Python loops run over the nibble slots of a word)
# --------------------------------------------------------------------------------------------------------------

def _pack_nibbles(xp, vals, element_in_slot, out_dtype):
    """Pack the last axis (length len(element_in_slot)) of ``vals`` into one word per row.

    Slot i (bits 4i..4i+3) receives ``vals[..., element_in_slot[i]]``. Returns ``out_dtype`` (int32/int16).
    """
    v = vals.astype(xp.uint32)
    out = xp.zeros(v.shape[:-1], dtype=xp.uint32)
    for slot, element in enumerate(element_in_slot):
        out |= v[..., element] << xp.uint32(4 * slot)
    if np.dtype(out_dtype).itemsize == 2:
        return out.astype(xp.uint16).view(out_dtype)
    return out.view(out_dtype)


def _unpack_nibbles(xp, words, slot_of_element):
    """Inverse of ``_pack_nibbles``: unsigned words [...] -> uint8 [..., len(slot_of_element)].

    Element j is read from slot ``slot_of_element[j]``. Words must already be unsigned (P17: an arithmetic
    shift of a negative int32 would drag in sign bits).
    """
    shifts = xp.asarray(np.asarray(slot_of_element, dtype=np.uint32) * np.uint32(4))
    return ((words.astype(xp.uint32)[..., None] >> shifts) & xp.uint32(0xF)).astype(xp.uint8)


# --------------------------------------------------------------------------------------------------------------
# Per-format packers: logical (validated, S float16) -> packed dict
# --------------------------------------------------------------------------------------------------------------

def _pack_gemm(xp, Q, Z, S16, K, N, G):
    # docs/formats.md §The gemm layout: word [r, c] holds element 8c + ORDER[i] of row r in slot i, for qweight
    # and qzeros alike.
    return {
        "qweight": _pack_nibbles(xp, Q.reshape(K, N // 8, 8), ORDER, xp.int32),
        "qzeros": _pack_nibbles(xp, Z.reshape(K // G, N // 8, 8), ORDER, xp.int32),
        "scales": S16,
    }


def _pack_gemv(xp, Q, Z, S16, K, N, G):
    # docs/formats.md §The gemv layout: transposed ([N, ...]), packed sequentially along K; zeros and scales
    # padded to ZW words.
    NG, ZW = K // G, zeros_width(K, G)
    qweight = _pack_nibbles(xp, Q.T.reshape(N, K // 8, 8), _SEQ, xp.int32)
    zpad = xp.zeros((N, 8 * ZW), dtype=xp.uint8)
    zpad[:, :NG] = Z.T
    scales = xp.zeros((N, 8 * ZW), dtype=xp.float16)
    scales[:, :NG] = S16.T
    return {"qweight": qweight, "qzeros": _pack_nibbles(xp, zpad.reshape(N, ZW, 8), _SEQ, xp.int32),
            "scales": scales}


# gemv_fast closed form (docs/formats.md §The gemv_fast layout). Write k = 64c + 32h + 8u + 2a + v and
# n = 4r + i. Element Q[k, n] is nibble
#   e = 256c + 64i + 32h + 8a + 4v + u
# of packed row r, and nibble e sits in int16 e // 4 at slot e % 4 (= u). Both directions are one transpose:
#   logical axes  (c, h, u, a, v | r, i)   <->   packed axes  (r | c, i, h, a, v | u)
_GF_TO_PACKED = (5, 0, 6, 1, 3, 4, 2)     # logical (c,h,u,a,v,r,i) -> packed (r,c,i,h,a,v,u)
_GF_TO_LOGICAL = (1, 3, 6, 4, 5, 0, 2)    # packed (r,c,i,h,a,v,u) -> logical (c,h,u,a,v,r,i)


def _pack_gemv_fast(xp, Q, Z, S16, K, N, G):
    NG, ZW = K // G, zeros_width(K, G)
    nib = Q.reshape(K // 64, 2, 4, 4, 2, N // 4, 4).transpose(_GF_TO_PACKED).reshape(N // 4, K, 4)
    qweight = _pack_nibbles(xp, nib, _SEQ[:4], xp.int16)
    scales = xp.zeros((8 * ZW, N), dtype=xp.float16)
    scales[:NG] = S16
    # SZ = -(S*Z): the product is exact in float32 (11-bit mantissa x 4-bit integer) and rounded once to fp16,
    # which is what AutoAWQ stores (docs/formats.md §The gemv_fast layout). Padded rows stay +0.
    szeros = xp.zeros((8 * ZW, N), dtype=xp.float16)
    szeros[:NG] = (-(S16.astype(xp.float32) * Z.astype(xp.float32))).astype(xp.float16)
    return {"qweight": qweight, "qzeros": szeros, "scales": scales}


# Marlin tile (docs/formats.md §The marlin layout). Write k = 16kt + 8f + 2r + e and n = 64nt + 16j + 8h + c. Word
# qweight[kt, 128nt + 4(4c + r) + j] holds, at value index 4h + 2f + e, the element Q[k, n]; value index idx
# sits in slot REV[idx] (ORDER applied inside every word).
_MARLIN_TO_PACKED = (0, 4, 7, 2, 5, 6, 1, 3)    # (kt,f,r,e,nt,j,h,c) -> (kt,nt,c,r,j,h,f,e)
_MARLIN_TO_LOGICAL = (0, 6, 3, 7, 1, 4, 5, 2)   # (kt,nt,c,r,j,h,f,e) -> (kt,f,r,e,nt,j,h,c)


def _pack_marlin(xp, Q, Z, S16, K, N, G):
    if Z is not None and bool((Z != _MARLIN_ZERO).any()):
        idx = _first_index(xp, Z != _MARLIN_ZERO)
        raise ValueError(f"marlin is symmetric: Z must be None or all {_MARLIN_ZERO}; found {int(Z[idx])} at "
                         f"index {idx}. Use gemm (or gemv/gemv_fast) for asymmetric weights")
    tiles = Q.reshape(K // 16, 2, 4, 2, N // 64, 4, 2, 8).transpose(_MARLIN_TO_PACKED)
    qweight = _pack_nibbles(xp, tiles.reshape(K // 16, N // 64, 32, 4, 8), ORDER, xp.int32)
    return {"qweight": qweight.reshape(K // 16, 2 * N), "scales": _marlin_permute_scales(xp, S16, K, G)}


def _marlin_permute_scales(xp, S, K, G, inverse=False):
    NG, N = S.shape
    if G == K:   # one group: per-channel scales, applied by Marlin at write-out
        perm, width = (_SINGLE_PERM_INV if inverse else SINGLE_PERM), len(SINGLE_PERM)
    else:
        perm, width = (_SCALE_PERM_INV if inverse else SCALE_PERM), len(SCALE_PERM)
    idx = xp.asarray(np.asarray(perm, dtype=np.int64))
    return xp.ascontiguousarray(S.reshape(-1, width)[:, idx].reshape(NG, N))


_PACKERS = {"gemm": _pack_gemm, "gemv": _pack_gemv, "gemv_fast": _pack_gemv_fast, "marlin": _pack_marlin}


def pack(Q, Z, S, fmt, group_size) -> dict:
    """Pack logical ``(Q, Z, S)`` into the tensors of ``fmt``, exactly as AutoAWQ writes them.

    Q uint8-compatible integers [K, N] (0..15), Z integers [K/G, N] (0..15), S float [K/G, N] (float16; other
    float dtypes are rounded to float16, the storage dtype). ``group_size`` -1 means G = K.

    Returns ``{"qweight", "qzeros", "scales"}`` (``marlin``: no ``qzeros``) on the inputs' array module:

    * gemm: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N].
    * gemv: qweight int32 [N, K/8], qzeros int32 [N, ZW], scales fp16 [N, 8·ZW] (padding zero).
    * gemv_fast: qweight int16 [N/4, K], qzeros fp16 [8·ZW, N] = fp16(-(S·Z)) computed in float32,
      scales fp16 [8·ZW, N] (padded rows zero). llm-awq names the zero tensor ``scaled_zeros``.
    * marlin: qweight int32 [K/16, 2N], scales fp16 [K/G, N] permuted (SCALE_PERM, or SINGLE_PERM when G = K).
      Symmetric: Z must be None or all 8. Needs K % 16 == 0 and N % 64 == 0.
    """
    fmt = _check_fmt(fmt)
    xp, Q, Z, S, K, N, G = _check_logical(Q, Z, S, group_size, z_optional=(fmt == "marlin"))
    _check_layer(fmt, K, N, G)
    S16 = S.astype(xp.float16) if np.dtype(S.dtype) != np.float16 else S.copy()
    return _PACKERS[fmt](xp, Q, Z, S16, K, N, G)


# --------------------------------------------------------------------------------------------------------------
# Packed tensors: loading, validation, unpacking
# --------------------------------------------------------------------------------------------------------------

class _Packed(NamedTuple):
    xp: Any
    fmt: str
    K: int
    N: int
    G: int
    qweight: Any
    zeros: Any          # qzeros / scaled_zeros, or None (marlin)
    zeros_name: str
    scales: Any


def _describe(tensors) -> str:
    parts = []
    for name, a in tensors.items():
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            parts.append(f"{name} {a.dtype} {tuple(a.shape)}")
        else:
            parts.append(f"{name} {type(a).__name__}")
    return ", ".join(parts) if parts else "no tensors"


def _require_mapping(tensors) -> None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, got {type(tensors).__name__}")


def _gemv_fast_zero_name(tensors) -> str:
    present = [k for k in _GF_ZERO_KEYS if k in tensors]
    if len(present) == 2:
        raise FormatError("gemv_fast tensors hold both 'qzeros' and 'scaled_zeros'; expected one of them")
    if not present:
        raise FormatError(f"gemv_fast needs a zero tensor named 'qzeros' or 'scaled_zeros'; got "
                          f"{_describe(tensors)}")
    return present[0]


def _load_packed(tensors, fmt: str, in_features, group_size) -> _Packed:
    """Fetch and validate the tensors of ``fmt`` (dtypes, shapes against K, N, G); N comes from qweight."""
    _require_mapping(tensors)
    K = _positive_int(in_features, "in_features")
    zeros_name = "" if fmt == "marlin" else ("qzeros" if fmt != "gemv_fast" else _gemv_fast_zero_name(tensors))
    needed = ["qweight", "scales"] + ([zeros_name] if zeros_name else [])
    missing = [k for k in needed if k not in tensors]
    if missing:
        raise FormatError(f"{fmt} tensors need {needed}; missing {missing} in {_describe(tensors)}")
    xp = get_xp(*(tensors[k] for k in needed))
    qweight, scales = xp.asarray(tensors["qweight"]), xp.asarray(tensors["scales"])
    zeros = xp.asarray(tensors[zeros_name]) if zeros_name else None

    if fmt == "gemv_fast":
        if np.dtype(qweight.dtype) not in _HALFWORD_DTYPES:
            raise TypeError(f"gemv_fast qweight must be int16 (or uint16), got {qweight.dtype}")
        _float_kind(zeros, f"gemv_fast {zeros_name}")
    else:
        if np.dtype(qweight.dtype) not in _WORD_DTYPES:
            raise TypeError(f"{fmt} qweight must be int32 (or uint32) packed words, got {qweight.dtype}")
        if zeros is not None and np.dtype(zeros.dtype) not in _WORD_DTYPES:
            raise TypeError(f"{fmt} qzeros must be int32 (or uint32) packed words, got {zeros.dtype}")
    _float_kind(scales, f"{fmt} scales")
    if qweight.ndim != 2:
        raise FormatError(f"{fmt} qweight must be 2-D, got shape {tuple(qweight.shape)}")

    R, C = (int(d) for d in qweight.shape)
    N = {"gemm": 8 * C, "gemv": R, "gemv_fast": 4 * R, "marlin": C // 2}[fmt]
    G = resolve_group_size(group_size, K)
    expected = packed_shapes(fmt, K, N, G)
    observed = {"qweight": qweight, "scales": scales}
    if zeros is not None:
        observed["qzeros"] = zeros
    for name, shape in expected.items():
        got = tuple(observed[name].shape)
        if got != shape:
            shown = zeros_name if name == "qzeros" else name
            raise FormatError(f"{fmt} {shown} has shape {got}, expected {shape} for K={K}, N={N}, "
                              f"group_size={G} (tensors: {_describe(tensors)})")
    return _Packed(xp, fmt, K, N, G, qweight, zeros, zeros_name, scales)


def _unpack_gemm(p: _Packed, strict: bool):
    xp, K, N, G = p.xp, p.K, p.N, p.G
    Q = _unpack_nibbles(xp, _word_view(xp, p.qweight, "qweight"), REV).reshape(K, N)
    Z = _unpack_nibbles(xp, _word_view(xp, p.zeros, "qzeros"), REV).reshape(K // G, N)
    return Q, Z, _to_float16_exact(xp, p.scales, "scales")


def _unpack_gemv(p: _Packed, strict: bool):
    xp, K, N, G = p.xp, p.K, p.N, p.G
    NG = K // G
    Q = _unpack_nibbles(xp, _word_view(xp, p.qweight, "qweight"), _SEQ).reshape(N, K).T
    Z = _unpack_nibbles(xp, _word_view(xp, p.zeros, "qzeros"), _SEQ).reshape(N, -1)[:, :NG].T
    S = _to_float16_exact(xp, p.scales[:, :NG].T, "scales")
    return xp.ascontiguousarray(Q), xp.ascontiguousarray(Z), xp.ascontiguousarray(S)


def _gemv_fast_codes(p: _Packed):
    xp, K, N = p.xp, p.K, p.N
    nib = _unpack_nibbles(xp, _word_view(xp, p.qweight, "qweight", _HALFWORD_DTYPES), _SEQ[:4])
    Q = nib.reshape(N // 4, K // 64, 4, 2, 4, 2, 4).transpose(_GF_TO_LOGICAL).reshape(K, N)
    return xp.ascontiguousarray(Q)


def _recover_zeros(xp, S32, SZ32, kind: str, strict: bool):
    """Integer Z with SZ = round_kind(-(S·Z)), from float32 S and SZ [NG, N]."""
    nonzero = S32 != 0
    with np.errstate(over="ignore", invalid="ignore"):   # garbage ratios are caught by the checks below
        Zf = xp.where(nonzero, xp.rint(-SZ32 / xp.where(nonzero, S32, 1)), 0)
    if not strict:
        Zf = xp.where(xp.isfinite(Zf), xp.clip(Zf, 0, _MAX_CODE), 0)
        return Zf.astype(xp.uint8)
    # A zero scale makes every weight of the group 0 whatever Z is, so Z = 0 there; but then SZ must be 0 too.
    orphan = ~nonzero & (SZ32 != 0)
    if bool(orphan.any()):
        idx = _first_index(xp, orphan)
        raise FormatError(f"gemv_fast group {idx} has scale 0 but scaled zero {float(SZ32[idx])!r}, which "
                          "(Q - Z)·S cannot express; pass strict=False to drop it")
    # Exact for AutoAWQ/llm-awq files: S·Z is exact in float32 and was rounded once to the storage dtype,
    # with a relative error far below 1/(2·15), so rint(-SZ/S) returns Z. Re-deriving SZ proves it.
    with np.errstate(over="ignore", invalid="ignore"):
        wrong = nonzero & ((Zf < 0) | (Zf > _MAX_CODE) | (_round_as(xp, -(S32 * Zf), kind) != SZ32))
    if bool(wrong.any()):
        idx = _first_index(xp, wrong)
        raise FormatError(f"gemv_fast zeros at group/column {idx} are not -(S·Z) for an integer Z in "
                          f"0..{_MAX_CODE} (S={float(S32[idx])!r}, scaled zero={float(SZ32[idx])!r}); pass "
                          "strict=False to round Z to the nearest code")
    return Zf.astype(xp.uint8)


def _unpack_gemv_fast(p: _Packed, strict: bool):
    xp, NG = p.xp, p.K // p.G
    Q = _gemv_fast_codes(p)
    S32 = _to_float32(xp, p.scales[:NG], "scales")
    SZ32 = _to_float32(xp, p.zeros[:NG], p.zeros_name)
    Z = _recover_zeros(xp, S32, SZ32, _float_kind(p.zeros, p.zeros_name), strict)
    return Q, Z, _to_float16_exact(xp, xp.ascontiguousarray(p.scales[:NG]), "scales")


def _unpack_marlin(p: _Packed, strict: bool):
    xp, K, N, G = p.xp, p.K, p.N, p.G
    words = _word_view(xp, p.qweight, "qweight").reshape(K // 16, N // 64, 32, 4)
    vals = _unpack_nibbles(xp, words, REV)                                  # kt, nt, lane, j, idx
    Q = vals.reshape(K // 16, N // 64, 8, 4, 4, 2, 2, 2).transpose(_MARLIN_TO_LOGICAL).reshape(K, N)
    S = _marlin_permute_scales(xp, _to_float16_exact(xp, p.scales, "scales"), K, G, inverse=True)
    Z = xp.full((K // G, N), _MARLIN_ZERO, dtype=xp.uint8)
    return xp.ascontiguousarray(Q), Z, S


_UNPACKERS = {"gemm": _unpack_gemm, "gemv": _unpack_gemv, "gemv_fast": _unpack_gemv_fast,
              "marlin": _unpack_marlin}


def unpack(tensors, fmt, in_features, group_size, *, strict: bool = True):
    """Inverse of ``pack``: the packed tensors of ``fmt`` -> logical ``(Q, Z, S)``.

    Returns Q uint8 [K, N], Z uint8 [K/G, N], S float16 [K/G, N] on the tensors' array module. N is read from
    ``qweight``; every tensor's dtype and shape is checked against K, N and G (``FormatError`` on a mismatch).
    Padding (gemv, gemv_fast) is dropped. Format notes:

    * gemv_fast: the zero tensor may be named ``qzeros`` (AutoAWQ) or ``scaled_zeros`` (llm-awq), and be
      float16, float32 or bfloat16 (``ml_dtypes.bfloat16``, or uint16 bit patterns). It stores -(S·Z), so Z is
      recovered as ``rint(-SZ / S)`` (0 where S == 0). That is exact for files AutoAWQ or llm-awq wrote
      (SZ = -(S·Z) rounded once); with ``strict=True`` (default) it is verified, and tensors that are not of
      that form raise ``FormatError``. ``strict=False`` rounds to the nearest code in 0..15 instead (lossy).
      Use ``unpack_scaled_zeros`` for the kernel-side view (S and SZ as stored).
    * marlin: Z is all 8 (symmetric); the scale permutation is undone.
    * Scales that are not float16 are converted exactly, or ``ValueError`` if that would round.
    """
    fmt = _check_fmt(fmt)
    return _UNPACKERS[fmt](_load_packed(tensors, fmt, in_features, group_size), bool(strict))


def unpack_scaled_zeros(tensors, in_features, group_size):
    """gemv_fast tensors as the kernels see them: ``(Q uint8 [K, N], S float32 [K/G, N], SZ float32 [K/G, N])``.

    ``W = Q·S + SZ`` (docs/formats.md §The gemv_fast layout). S and SZ are the stored values
    (float16/bfloat16/float32) converted exactly to float32, padding dropped; no zero point is recovered, so this
    works for any gemv_fast tensors.
    """
    p = _load_packed(tensors, "gemv_fast", in_features, group_size)
    NG = p.K // p.G
    S32 = _to_float32(p.xp, p.scales[:NG], "scales")
    SZ32 = _to_float32(p.xp, p.zeros[:NG], p.zeros_name)
    return _gemv_fast_codes(p), p.xp.ascontiguousarray(S32), p.xp.ascontiguousarray(SZ32)


# --------------------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------------------

def _shape_candidates(tensors) -> list:
    """Formats whose shape rules (docs/formats.md §Detection) the tensors satisfy, as LayerShape(fmt, K, N).

    Only shapes are compared.

    The rules are mutually exclusive, so at most one candidate comes back:
    * qweight int16/uint16 [R, C]: gemv_fast with K = C, N = 4R; zeros and scales [8·ZW, N].
    * qweight int32/uint32 [R, C] without zeros: marlin with K = 16R, N = C/2; scales [NG, N].
    * qweight int32/uint32 [R, C] with qzeros: the scales decide, which also settles square K = N layers
      (where gemm and gemv qweight shapes coincide): scales [R, 8·ZW] with qzeros [R, ZW] is gemv
      (K = 8C, N = R); scales [NG, 8C] with qzeros [NG, C] and NG < R dividing R is gemm (K = R, N = 8C).
      NG = R would mean G = 1 for gemm, which no AWQ producer writes, so the two cannot both match.
    """
    _require_mapping(tensors)
    if "qweight" not in tensors:
        raise FormatError(f"no 'qweight' tensor, so not an AWQ-quantized layer ({_describe(tensors)})")
    if "scales" not in tensors:
        raise FormatError(f"AWQ layers need a 'scales' tensor next to 'qweight' ({_describe(tensors)})")
    qw, sc = tensors["qweight"], tensors["scales"]
    if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in tensors.values() if a is not None):
        raise TypeError(f"tensors must map names to arrays ({_describe(tensors)})")
    if qw.ndim != 2 or sc.ndim != 2:
        return []
    R, C = (int(d) for d in qw.shape)
    SR, SC = (int(d) for d in sc.shape)
    zero_names = [k for k in _GF_ZERO_KEYS if k in tensors]
    dt = np.dtype(qw.dtype)
    if dt in _HALFWORD_DTYPES:
        if len(zero_names) == 1:
            z = tensors[zero_names[0]]
            if tuple(z.shape) == (SR, SC) and SC == 4 * R and SR % 8 == 0:
                return [LayerShape("gemv_fast", C, 4 * R)]
        return []
    if dt not in _WORD_DTYPES:
        return []
    if not zero_names:
        if C % 2 == 0 and SC == C // 2 and SR > 0 and (16 * R) % SR == 0:
            return [LayerShape("marlin", 16 * R, C // 2)]
        return []
    if zero_names != ["qzeros"] or tensors["qzeros"].ndim != 2:
        return []
    ZR, ZC = (int(d) for d in tensors["qzeros"].shape)
    if SR == R and ZR == R and SC == 8 * ZC:
        return [LayerShape("gemv", 8 * C, R)]
    if SC == 8 * C and (ZR, ZC) == (SR, C) and 0 < SR < R and R % SR == 0:
        return [LayerShape("gemm", R, 8 * C)]
    return []


def detect_format(tensors, in_features, out_features) -> str:
    """The AWQ format of a known K x N layer's tensors, from dtypes and shapes (docs/formats.md §Detection).

    int16 qweight -> gemv_fast; int32 qweight without zeros and [K/16, 2N] -> marlin; otherwise gemm
    ([K, N/8]) or gemv ([N, K/8]), told apart by the ``scales`` shape ([K/G, N] vs [N, 8·ZW]), which also
    resolves square K = N layers. Only shapes are compared; ``unpack`` validates the rest. Raises
    ``FormatError`` naming the observed tensors when nothing matches.
    """
    K = _positive_int(in_features, "in_features")
    N = _positive_int(out_features, "out_features")
    candidates = _shape_candidates(tensors)
    hits = [c.fmt for c in candidates if (c.in_features, c.out_features) == (K, N)]
    if len(hits) == 1:
        return hits[0]
    hint = ""
    if candidates:
        c = candidates[0]
        hint = (f"; they look like {c.fmt} with in_features={c.in_features}, out_features={c.out_features}: "
                "check the layer shape")
    elif np.dtype(tensors["qweight"].dtype) in _WORD_DTYPES and tuple(tensors["qweight"].shape) == (K // 8, N):
        hint = "; qweight [K/8, N] is an exllama/GPTQ-style runtime repack, not an AWQ file layout"
    raise FormatError(f"cannot detect the AWQ format of a layer with K={K}, N={N} from {_describe(tensors)}"
                      f"{hint}")


def infer_shape(tensors, group_size=None) -> LayerShape:
    """``LayerShape(fmt, in_features, out_features)`` of one layer's tensors, without knowing K and N.

    Uses the shape rules of ``detect_format`` (see ``_shape_candidates``): gemm qweight [K, N/8] with scales
    [NG, N]; gemv qweight [N, K/8] with scales [N, 8·ZW]; gemv_fast qweight int16 [N/4, K]; marlin qweight
    [K/16, 2N] without zeros. Those shapes alone determine K and N. When ``group_size`` is given (checkpoint
    loaders know it from the config), every tensor is then fully validated as ``unpack`` would (dtypes,
    padded widths, K % G); without it only shapes are checked. Raises ``FormatError`` when nothing matches.
    """
    candidates = _shape_candidates(tensors)
    if len(candidates) != 1:
        raise FormatError(f"the tensors match no AWQ format ({_describe(tensors)})")
    found = candidates[0]
    if group_size is not None:
        _load_packed(tensors, found.fmt, found.in_features, group_size)
    return found


# --------------------------------------------------------------------------------------------------------------
# Converters
# --------------------------------------------------------------------------------------------------------------

def convert(tensors, src_fmt, dst_fmt, in_features, group_size, *, strict: bool = True) -> dict:
    """Repack one layer from ``src_fmt`` to ``dst_fmt`` through the logical form (``unpack`` then ``pack``).

    ``bias`` is passed through unchanged when present; other extra tensors are dropped. The result is exact
    (dequantizes to the same weights) for every pair, with two caveats: a destination of ``marlin`` needs
    symmetric weights (Z all 8, else ``ValueError``) and marlin's shape rules; a source of ``gemv_fast`` goes
    through Z = rint(-SZ/S), see ``unpack`` (``strict``).
    """
    src, dst = _check_fmt(src_fmt), _check_fmt(dst_fmt)
    Q, Z, S = unpack(tensors, src, in_features, group_size, strict=strict)
    out = pack(Q, Z, S, dst, group_size)
    if "bias" in tensors:
        out["bias"] = tensors["bias"]
    return out


def to_gemm(tensors, fmt, in_features, group_size, *, strict: bool = True) -> dict:
    """The gemm tensors (qweight, qzeros, scales, and bias if present) of one layer stored as ``fmt``.

    gemm is the only layout vLLM and most tools read (docs/formats.md §Converting and writing). From gemv_fast,
    Z is recovered as rint(-SZ/S): exact for checkpoints AutoAWQ or llm-awq wrote, where SZ = -(S·Z) rounded once
    (verified unless ``strict=False``). From marlin, qzeros are all 8.
    """
    return convert(tensors, fmt, "gemm", in_features, group_size, strict=strict)
