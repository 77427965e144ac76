"""Round-to-nearest 4-bit quantizer with AutoAWQ's exact semantics (``pseudo_quantize_tensor``).

Layout warning: ``quantize`` takes the weight as stored by ``nn.Linear`` and in checkpoints, i.e. **[N, K] =
[out_features, in_features]**, and returns the library's logical layout **Q [K, N], Z [K/G, N], S [K/G, N]**
(``W = (Q - Z) * S`` with ``W = weight.T``). ``QuantizedTensors.fake_quant()`` goes back to [N, K].

This module does only the rounding. The "activation-aware" part of AWQ (searching per-channel scales on
calibration data and folding them into the previous layer) happens before it and is out of scope here: what
AutoAWQ hands to its packers is exactly ``pseudo_quantize_tensor`` of the already-scaled weight, and that is
what ``quantize`` reproduces (bit for bit for float16 input; see ``tests/test_quantize.py``).

Math, per output channel n and group g of G consecutive input weights w (docs/formats.md §Quantizer):

* ``zero_point=True`` (asymmetric; the gemm/gemv/gemv_fast packers need it)::

      s = max(max(w) - min(w), 1e-5) / 15
      z = clamp(-round(min(w) / s), 0, 15)
      q = clamp(round(w / s) + z, 0, 15)

* ``zero_point=False`` (symmetric; AutoAWQ's ``marlin`` version)::

      s = max(max|w|, 1e-5) / 7
      q = clamp(round(w / s), -8, 7) + 8          stored with Z = 8 everywhere

``round`` is round-half-to-even (``torch.round``). For float16 input every step is evaluated in float16, one
rounding per operation, as PyTorch does on the CPU; numpy and CuPy float16 arithmetic round the same way.

Accepted input dtypes:

* ``float16``: AutoAWQ's result bit for bit (its models are cast to fp16 before quantization).
* ``float32`` and ``bfloat16`` (``ml_dtypes.bfloat16``, numpy only): the same formulas in float32, except that
  the scale is rounded to float16 *before* z and q are computed from it. The stored S is float16 in every AWQ
  format, so this keeps Q, Z and S self-consistent: ``(Q - Z) * S`` is exactly the fake-quantized weight.
  (Evaluating with the unrounded float32 scale, then rounding it for storage, would not be.)

Known behaviour inherited from AutoAWQ (kept on purpose for bit-exactness): the quantization grid always
contains 0, because z is an integer in 0..15. A group whose values all lie far from 0 relative to its range
(a constant non-zero row is the extreme case) is clamped to the nearest end of the grid, i.e. to about
``±15 s``. Such values are not reconstructed within ``s / 2``; every value inside ``[-z s, (15 - z) s]`` is.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._array import bfloat16_dtype, get_xp, is_bfloat16, is_cupy
from .formats import pack, resolve_group_size

__all__ = ["QuantizedTensors", "quantize"]

_MAX_Q = 15          # 4-bit unsigned codes 0..15
_SYM_MAX = 7         # symmetric codes -8..7 ...
_SYM_OFFSET = 8      # ... stored as q + 8, i.e. with an implicit zero point of 8
_MIN_RANGE = 1e-5    # AutoAWQ's clamp on the group range (max-min, or max|w|) that keeps s > 0


class QuantizedTensors(NamedTuple):
    """Logical (unpacked) 4-bit weights in the library layout. ``W[k, n] = (Q[k, n] - Z[g, n]) * S[g, n]``.

    Q: uint8 [K, N], values 0..15.       Z: uint8 [K/G, N], values 0..15 (all 8 for symmetric).
    S: float16 [K/G, N].                 group_size: the resolved G (a config value of -1 is stored as K).
    Arrays are numpy or cupy, like the weight that was quantized.
    """

    Q: Any
    Z: Any
    S: Any
    group_size: int

    @property
    def in_features(self) -> int:
        return int(self.Q.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.Q.shape[1])

    def dequantize(self, dtype=np.float16):
        """W [K, N] in ``dtype`` (float16, float32 or bfloat16): float32 ``(Q - Z) * S``, rounded once.

        For float16 and float32 the result is exact (a small integer times a float16 is exact in float32).
        """
        out_dtype = _check_out_dtype(dtype)
        get_xp(self.Q, self.Z, self.S)          # mixing numpy and cupy is a TypeError
        K, N = self.Q.shape
        G = self.group_size
        q = self.Q.astype(np.float32).reshape(K // G, G, N)
        z = self.Z.astype(np.float32)[:, None, :]
        s = self.S.astype(np.float32)[:, None, :]
        return ((q - z) * s).reshape(K, N).astype(out_dtype)

    def fake_quant(self, dtype=np.float16):
        """[N, K] weight like AutoAWQ's ``pseudo_quantize_tensor`` output, contiguous.

        Bit-equal for float16 input, up to the sign of zero: AutoAWQ's symmetric path yields ``-0.0`` where
        ``round(w / s)`` is ``-0``; ``(Q - Z) * S`` cannot know that sign and gives ``+0.0``.
        """
        w = self.dequantize(dtype)
        return get_xp(w).ascontiguousarray(w.T)

    def pack(self, fmt: str) -> dict:
        """Pack into one of ``awq_cupy.formats.FORMATS`` (shortcut for ``formats.pack``)."""
        return pack(self.Q, self.Z, self.S, fmt, self.group_size)


def _check_out_dtype(dtype):
    dt = np.dtype(dtype)
    if dt in (np.dtype(np.float16), np.dtype(np.float32)) or is_bfloat16(dt):
        return dt
    raise TypeError(f"dtype must be float16, float32 or bfloat16, got {dt}")


def quantize(weight, group_size: int = 128, zero_point: bool = True) -> QuantizedTensors:
    """Quantize an **[N, K] (out_features, in_features)** weight to 4 bits; returns Q/Z/S in [K, N] layout.

    ``weight``: float16, float32 or bfloat16 numpy array, or float16/float32 cupy array (the result lives on the
    same side). Requirements: 2-D, ``N % 8 == 0`` (every packed format needs it), ``K % G == 0``, all values
    finite, and group ranges small enough for a finite float16 scale (for float16 input: max - min must not
    overflow float16). ``group_size``: -1 (one group of K), K itself, or any positive divisor of K that is a
    multiple of 8 (``formats.resolve_group_size``; this covers 32/64/128 and odd model shapes like 344).
    Invalid values raise ValueError/TypeError. See the module docstring for the exact math.
    """
    if not isinstance(zero_point, bool):
        raise TypeError(f"zero_point must be a bool, got {type(zero_point).__name__}")
    if not hasattr(weight, "ndim") or not hasattr(weight, "dtype"):
        raise TypeError(f"weight must be a numpy or cupy array, got {type(weight).__name__}")
    xp = get_xp(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    N, K = (int(d) for d in weight.shape)
    if N == 0 or K == 0:
        raise ValueError(f"weight shape {(N, K)} is empty")
    if N % 8:
        raise ValueError(f"out_features {N=} (weight.shape[0]) is not a multiple of 8 (needed for packing)")
    G = resolve_group_size(group_size, K)

    if weight.dtype == np.float16:
        cdt = np.dtype(np.float16)          # AutoAWQ computes in the layer dtype: fp16 op by op
    elif weight.dtype == np.float32 or (is_bfloat16(weight.dtype) and not is_cupy(weight)):
        cdt = np.dtype(np.float32)          # bf16 -> fp32 is exact
    else:
        accepted = "float16, float32" + (", bfloat16" if bfloat16_dtype() is not None else "")
        raise TypeError(f"weight dtype {weight.dtype} is not supported; accepted: {accepted}")

    w = weight.astype(cdt).reshape(N, K // G, G)
    if not bool(xp.isfinite(w).all()):
        bad = int((~xp.isfinite(w)).sum())
        raise ValueError(f"weight holds {bad} non-finite value(s) (NaN/inf); AWQ quantization needs finite input")

    one = cdt.type
    # Overflow to inf inside min/s or w/s (a group far from 0 with a tiny range) is AutoAWQ's behaviour too:
    # the clamps map it to 0 or 15; tiny scales are float16 subnormals. Silence numpy's warnings for these;
    # s itself is checked below.
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        if zero_point:
            hi = w.max(axis=-1, keepdims=True)
            lo = w.min(axis=-1, keepdims=True)
            s = xp.maximum(hi - lo, one(_MIN_RANGE)) / one(_MAX_Q)
            s = _as_fp16_scale(s, cdt)
            z = xp.clip(-xp.round(lo / s), one(0), one(_MAX_Q))
            q = xp.clip(xp.round(w / s) + z, one(0), one(_MAX_Q))
        else:
            amax = xp.abs(w).max(axis=-1, keepdims=True)
            s = xp.maximum(amax, one(_MIN_RANGE)) / one(_SYM_MAX)
            s = _as_fp16_scale(s, cdt)
            q = xp.clip(xp.round(w / s), one(-_SYM_OFFSET), one(_SYM_MAX)) + one(_SYM_OFFSET)
            z = xp.full(s.shape, _SYM_OFFSET, dtype=cdt)

    S = s[..., 0].astype(np.float16)
    if not bool(xp.isfinite(S).all()):
        raise ValueError(
            "a group's range is too large for a float16 scale (max - min or max|w| overflows float16); "
            "AWQ stores scales as float16")
    Q = xp.ascontiguousarray(q.reshape(N, K).T.astype(np.uint8))
    Z = xp.ascontiguousarray(z[..., 0].T.astype(np.uint8))
    return QuantizedTensors(Q=Q, Z=Z, S=xp.ascontiguousarray(S.T), group_size=G)


def _as_fp16_scale(s, cdt):
    """For float32 compute, round s to float16 before it is used (see module docstring); no-op for float16."""
    if cdt == np.float16:
        return s
    return s.astype(np.float16).astype(cdt)
