"""Numpy reference math for AWQ W4A16 layers: the ground truth every GPU kernel test compares against.

Convention (see ``awq_cupy.formats``): ``Q`` uint8 [K, N], ``Z`` uint8 [K/G, N], ``S`` float16 [K/G, N],
``W[k, n] = (Q[k, n] - Z[k // G, n]) * S[k // G, n]`` and a layer computes ``y = x @ W + bias``.

Everything here runs on the host in numpy. CuPy inputs are accepted and copied to the host first; results
are always numpy arrays. Nothing is tuned for speed.

Test tolerances are tied to a baseline, not picked by hand::

    ref      = matmul(x, Q, Z, S, G, bias)            # float64, no rounding anywhere but the inputs
    baseline = matmul_baseline(x, Q, Z, S, G, bias)   # the same math with W, x and y rounded to fp16/bf16
    assert_close(out, ref, baseline, c=2)             # max|out - ref| <= c * max|baseline - ref| + atol
"""
from __future__ import annotations

import numpy as np

from ._array import bfloat16_dtype, is_bfloat16, to_numpy
from .formats import _check_fmt, unpack, unpack_scaled_zeros, validate_logical

__all__ = [
    "dequantize",
    "dequantize_packed",
    "matmul",
    "matmul_packed",
    "matmul_baseline",
    "assert_close",
]

_MAX_REPORTED = 5   # mismatching elements listed in an assert_close message


def _dtype_or_bf16(dtype):
    """np.dtype of ``dtype``, also for the string 'bfloat16' (ml_dtypes)."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        bf = bfloat16_dtype()
        if bf is None:
            raise TypeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return bf
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"not a dtype: {dtype!r}") from None


def _check_out_dtype(dtype, allowed, what: str):
    dt = _dtype_or_bf16(dtype)
    if not any(dt == a for a in allowed):
        names = ", ".join(str(a) for a in allowed)
        raise TypeError(f"{what} dtype must be one of {names}; got {dt}")
    return dt


def _low_precision_dtypes():
    bf = bfloat16_dtype()
    return (np.dtype(np.float16),) + ((bf,) if bf is not None else ())


def _is_float(a) -> bool:
    return np.dtype(a.dtype).kind == "f" or is_bfloat16(a.dtype)


def _dequantize_host(Q, Z, S, group_size, math_dtype):
    """(Q - Z) * S in ``math_dtype`` (float32 or float64); exact for float16 S (5-bit integer x 11-bit)."""
    K, N, G = validate_logical(Q, Z, S, group_size)
    NG = K // G
    q = Q.reshape(NG, G, N).astype(math_dtype)
    z = Z.reshape(NG, 1, N).astype(math_dtype)
    s = np.asarray(S).astype(math_dtype).reshape(NG, 1, N)
    return ((q - z) * s).reshape(K, N)


def dequantize(Q, Z, S, group_size, dtype=np.float32):
    """Dense ``W [K, N] = (Q - Z[k // G]) * S[k // G]`` as a numpy array of ``dtype``.

    ``dtype``: float32 or float64 (exact values: the product of a small integer and a float16 scale fits in
    float32), or float16 / bfloat16, which round that exact float32 value once: ``fp16(float32(q - z) *
    float32(s))`` is bit-identical to the GPU dequant kernel (docs/formats.md §Dequantization). S may be any
    float dtype; it is used as given (float64 math when float64 is asked for, float32 otherwise).
    """
    Q, Z, S = to_numpy(Q), to_numpy(Z), to_numpy(S)
    out = _check_out_dtype(dtype, (np.dtype(np.float32), np.dtype(np.float64)) + _low_precision_dtypes(),
                           "dequantize")
    math = np.float64 if out == np.float64 else np.float32
    W = _dequantize_host(Q, Z, S, group_size, math)
    return W if W.dtype == out else W.astype(out)


def dequantize_packed(tensors, fmt, in_features, group_size, dtype=np.float32):
    """Dense ``W [K, N]`` of packed tensors, with the dequantization each format's kernels perform.

    gemm, gemv, marlin: ``(Q - Z) * S`` as ``dequantize``. gemv_fast: ``Q * S + SZ`` with the stored scaled
    zeros SZ = fp(-(S·Z)) (docs/formats.md §Dequantization); the float32 value is exact (both terms are
    multiples of the scale's ulp and fit in 16 bits), so the float16 result equals the kernels' single-rounding
    ``hfma2`` and may differ from ``(Q - Z) * S`` by one ulp. bf16 scales/zeros (llm-awq) are used as stored.
    """
    fmt = _check_fmt(fmt)
    out = _check_out_dtype(dtype, (np.dtype(np.float32), np.dtype(np.float64)) + _low_precision_dtypes(),
                           "dequantize_packed")
    host = {k: to_numpy(v) for k, v in tensors.items()} if hasattr(tensors, "items") else tensors
    if fmt != "gemv_fast":
        return dequantize(*unpack(host, fmt, in_features, group_size), group_size, dtype=out)
    Q, S, SZ = unpack_scaled_zeros(host, in_features, group_size)
    K, N = Q.shape
    NG = S.shape[0]
    math = np.float64 if out == np.float64 else np.float32
    q = Q.reshape(NG, K // NG, N).astype(math)
    W = (q * S.astype(math)[:, None, :] + SZ.astype(math)[:, None, :]).reshape(K, N)
    return W if W.dtype == out else W.astype(out)


def _activations(x, K: int):
    x = to_numpy(x)
    if not _is_float(x):
        raise TypeError(f"x must be a floating-point array (float16, bfloat16, float32, float64), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"x has shape {x.shape}; its last dimension must be K={K} (in_features)")
    return x


def _bias(bias, N: int):
    if bias is None:
        return None
    b = to_numpy(bias)
    if not _is_float(b):
        raise TypeError(f"bias must be a floating-point array, got {b.dtype}")
    if b.shape != (N,):
        raise ValueError(f"bias has shape {b.shape}, expected (N,) = ({N},)")
    return b


def _dense_matmul(x, W, bias, dtype):
    y = x.astype(dtype) @ W.astype(dtype)
    if bias is not None:
        y += bias.astype(dtype)
    return y


def matmul(x, Q, Z, S, group_size, bias=None, dtype=np.float64):
    """Reference layer output ``x @ W + bias`` computed in ``dtype`` (float64 default, or float32).

    ``x`` [..., K] of any float dtype (float16, ``ml_dtypes.bfloat16``, float32, float64) is used exactly as
    given (widened, never rounded). Returns numpy [..., N] of ``dtype``.
    """
    dt = _check_out_dtype(dtype, (np.dtype(np.float32), np.dtype(np.float64)), "matmul")
    Q, Z, S = to_numpy(Q), to_numpy(Z), to_numpy(S)
    K, N, _ = validate_logical(Q, Z, S, group_size)
    x = _activations(x, K)
    return _dense_matmul(x, _dequantize_host(Q, Z, S, group_size, dt), _bias(bias, N), dt)


def matmul_packed(x, tensors, fmt, in_features, group_size, bias=None, dtype=np.float64):
    """``matmul`` for packed tensors, with the format's own dequantization (``dequantize_packed``).

    ``bias`` defaults to ``tensors["bias"]`` when present; pass an array to override it.
    """
    dt = _check_out_dtype(dtype, (np.dtype(np.float32), np.dtype(np.float64)), "matmul_packed")
    W = dequantize_packed(tensors, fmt, in_features, group_size, dtype=dt)
    K, N = W.shape
    if bias is None and hasattr(tensors, "get"):
        bias = tensors.get("bias")
    return _dense_matmul(_activations(x, K), W, _bias(bias, N), dt)


def matmul_baseline(x, Q, Z, S, group_size, bias=None, dtype=np.float16):
    """The same layer as ``matmul`` with the rounding an ideal half-precision kernel cannot avoid.

    ``dtype`` float16 or bfloat16: ``x`` is rounded to it, W is dequantized to it (one rounding, as the GPU
    does), the product and bias are accumulated in float64 and the result is rounded to it once. Its error
    against ``matmul`` sizes test tolerances (``assert_close``). Returns numpy [..., N] of ``dtype``.
    """
    lo = _check_out_dtype(dtype, _low_precision_dtypes(), "matmul_baseline")
    Q, Z, S = to_numpy(Q), to_numpy(Z), to_numpy(S)
    K, N, _ = validate_logical(Q, Z, S, group_size)
    x = _activations(x, K).astype(lo)
    W = dequantize(Q, Z, S, group_size, dtype=lo)
    b = _bias(bias, N)
    b = None if b is None else b.astype(lo)
    return _dense_matmul(x, W, b, np.float64).astype(lo)


def _fmt_index(idx) -> str:
    return "(" + ", ".join(str(int(i)) for i in idx) + ")"


def assert_close(out, ref, baseline, c=2.0, atol=1e-6, rtol=None, name="output"):
    """Assert ``max|out - ref| <= c * max|baseline - ref| + atol``, elementwise.

    ``out``: the result under test; ``ref``: the float64 reference (``matmul``); ``baseline``: the same math
    in the kernel's precision (``matmul_baseline``). numpy or CuPy arrays of equal shape. NaN must appear in
    ``out`` exactly where it appears in ``ref``; infinities must match exactly. With ``rtol``, also
    ``max|out - ref| <= rtol * max|ref|``. On failure the AssertionError reports the tolerance, the max error
    and its index, the number of mismatching elements, the first few (index, ref, got) and NaN mismatches.
    """
    o = np.asarray(to_numpy(out))
    r = np.asarray(to_numpy(ref))
    b = np.asarray(to_numpy(baseline))
    if o.shape != r.shape:
        raise AssertionError(f"{name}: shape {o.shape} differs from the reference shape {r.shape}")
    if b.shape != r.shape:
        raise AssertionError(f"{name}: baseline shape {b.shape} differs from the reference shape {r.shape}")
    o64, r64, b64 = (a.astype(np.float64) for a in (o, r, b))
    with np.errstate(invalid="ignore", over="ignore"):   # inf - inf: infinities are compared separately
        return _check_close(o64, r64, b64, c, atol, rtol, name)


def _check_close(o64, r64, b64, c, atol, rtol, name):
    """The body of ``assert_close`` on float64 copies (out, ref, baseline)."""
    finite_base = np.isfinite(b64) & np.isfinite(r64)
    base_err = float(np.max(np.abs(b64 - r64)[finite_base])) if finite_base.any() else 0.0
    tol = c * base_err + atol

    nan_o, nan_r = np.isnan(o64), np.isnan(r64)
    nan_bad = nan_o != nan_r
    both_finite = np.isfinite(o64) & np.isfinite(r64)
    err = np.where(both_finite, np.abs(o64 - r64), 0.0)
    inf_bad = ~both_finite & ~(nan_o & nan_r) & ~nan_bad & (o64 != r64)   # inf vs finite, or inf of other sign
    bad = (err > tol) | nan_bad | inf_bad
    max_err = float(err.max()) if err.size else 0.0
    ref_scale = float(np.max(np.abs(r64[np.isfinite(r64)]))) if np.isfinite(r64).any() else 0.0
    rel_bad = rtol is not None and max_err > rtol * ref_scale

    if not bad.any() and not rel_bad:
        return
    lines = [f"{name}: {int(bad.sum())} of {bad.size} elements differ from the reference by more than "
             f"tol={tol:.4g} (= c·max|baseline - ref| + atol = {c:g}·{base_err:.4g} + {atol:.4g})"]
    if max_err > 0:
        where = np.unravel_index(int(np.argmax(err)), err.shape)
        lines.append(f"max |out - ref| = {max_err:.4g} over finite elements, at index {_fmt_index(where)} "
                     f"(ref={float(r64[where])!r}, got={float(o64[where])!r}); max|ref| = {ref_scale:.4g}")
    if rel_bad:
        lines.append(f"relative error max|out - ref| / max|ref| = {max_err / max(ref_scale, 1e-300):.4g} "
                     f"exceeds rtol={rtol:g}")
    if nan_bad.any():
        first = np.argwhere(nan_bad)[:_MAX_REPORTED]
        lines.append(f"NaN mismatches: {int(nan_bad.sum())}, first at " +
                     ", ".join(f"{_fmt_index(i)} (ref={float(r64[tuple(i)])!r}, got={float(o64[tuple(i)])!r})"
                               for i in first))
    if inf_bad.any():
        lines.append(f"infinity mismatches: {int(inf_bad.sum())}")
    first = np.argwhere(bad)[:_MAX_REPORTED]
    if len(first):
        pairs = (f"{_fmt_index(i)}: {float(r64[tuple(i)])!r}, {float(o64[tuple(i)])!r}" for i in first)
        lines.append("first mismatches (index: ref, got): " + "; ".join(pairs))
    raise AssertionError("\n".join(lines))
