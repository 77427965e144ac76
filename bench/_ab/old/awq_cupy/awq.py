"""Activation-aware weight quantization (the AWQ search) on numpy or CuPy arrays, without PyTorch.

What it does, for the linear layers that read one input ``x`` (q/k/v, gate/up, or a single layer):

1. **Scale search** (``search_scales``). For ``alpha`` on the grid ``0, 1/n_grid, ..., (n_grid-1)/n_grid``, take
   per-input-channel scales ``s = mean|x|^alpha`` (clamped to >= 1e-4), normalised by ``sqrt(max(s) * min(s))``,
   quantize ``W diag(s)`` with round-to-nearest and score the layer outputs of ``(x / s) @ Q(W diag(s))^T``
   against ``x @ W^T``: the mean squared error over every calibration token and every output of every layer.
   The best alpha wins (ties keep the smaller alpha). ``alpha = 0`` gives ``s = 1``, plain RTN, so the search
   never does worse than RTN on the calibration data. ``duo_scaling=True`` divides by a weight term
   ``w_mean^(1 - alpha)`` as AutoAWQ's default does; the default here is the paper's activation-only rule.
2. **Clip search** (``search_clip``), on the scaled weight and the scaled input ``x / s``. For every output
   channel and group, the range ``[min(w), max(w)]`` is shrunk to ``r [min(w), max(w)]`` for
   ``r = 1 - i / n_grid``, ``i = 0 .. int(max_shrink * n_grid) - 1``; each group keeps the ``r`` whose clamped
   RTN weights give the smallest mean squared error of that group's share of the output. (AutoAWQ clamps to
   ``+-r max|w|`` instead; shrinking both ends fits the asymmetric zero-point grid. With ``zero_point=False``
   both coincide.) ``r = 1`` is no clipping.
3. **Quantization** (``quantize_clipped``): clamp to the chosen ranges, then ``awq_cupy.quantize`` (AutoAWQ RTN
   semantics). Clamping first is exactly RTN with explicit ranges: the clamped group's max/min are the bounds.

``quantize_awq`` runs all three and returns ``QuantizedTensors`` of ``W diag(s)`` (ready for
``save_checkpoint``, which writes AutoAWQ's ``gemm`` layout) and the scales ``s``. The caller must then divide
the *input* of these layers by ``s``: fold ``1/s`` into the previous operation with ``fold_scales_into_norm``
(a LayerNorm/RMSNorm whose output feeds only these layers, as in pre-norm transformers) or
``fold_scales_into_linear`` (a previous linear whose output feeds only these layers through channel-wise ops,
e.g. v_proj -> o_proj). Where neither applies (a post-norm residual, an activation function in between), the
input has to be divided by ``s`` at run time (AutoAWQ's ``ScaledActivation``).

How the error is computed, and the memory bound. The mean squared output error of a weight error ``D`` (``W_hat
- W``, ``[N, K]``) over tokens ``x_t`` is ``mean_t,n (x_t . d_n)^2 = (1/N) sum_n d_n^T C d_n`` with
``C = X^T X / T``, the uncentred second moment of the calibration input. ``calibration_stats`` computes ``C``
and ``mean|x|`` once per input, streaming the rows in blocks, and every loss after that costs
``O(N K^2)`` (scales) or ``O(N K G)`` (clips) no matter how many tokens there are. The numbers are the same as
evaluating the layer outputs on every retained token, up to float32 rounding (no fp16 output rounding).

* At most ``max_tokens`` calibration rows are used (default ``DEFAULT_MAX_TOKENS`` = 65536, AutoAWQ's
  128 samples x 512 tokens). Above that, a subset of rows is drawn without replacement by
  ``numpy.random.default_rng(seed)`` on the host, the same for numpy and CuPy inputs: runs are deterministic
  for a fixed seed.
* Extra memory beyond the caller's arrays: ``C`` (``K x K`` float32), one block of at most ``2**24`` float32
  values of calibration rows, and a few weight-sized float32 temporaries per block of at most ``2**22``
  weight values (rows of ``W`` are processed in blocks). The calibration input may be one array ``[..., K]`` or
  a list of such arrays (e.g. one per batch); it is never concatenated.

All arithmetic is float32 (weights and activations of any float dtype are converted on the way in). Arrays may
be numpy or CuPy (not mixed); results live on the same side.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import numpy as np

from ._array import get_xp, is_bfloat16, make_reporter
from .formats import resolve_group_size
from .quantize import QuantizedTensors, quantize

__all__ = [
    "DEFAULT_MAX_TOKENS", "CalibrationStats", "ClipRange", "AWQResult", "calibration_stats", "scale_losses",
    "search_scales", "search_clip", "quantize_clipped", "quantize_awq", "fold_scales_into_norm",
    "fold_scales_into_linear", "output_mse",
]

DEFAULT_MAX_TOKENS = 65536      # calibration rows kept at most (AutoAWQ: 128 samples x 512 tokens)
_BLOCK_X = 1 << 24              # calibration values per streamed block (64 MiB of float32)
_BLOCK_W = 1 << 22              # weight values per block of rows in the searches (16 MiB of float32 each)
_MIN_SCALE = 1e-4               # AutoAWQ's clamp on the candidate scales (and on the duo denominator)
_W_MEAN_EPS = 1e-6              # AutoAWQ's epsilon in the per-group |w| / max|w| normalisation
_MAX_Q, _SYM_MAX, _SYM_MIN = 15, 7, -8
_MIN_RANGE = 1e-5               # quantize()'s clamp on the group range, reproduced by _fake_quant
_AUTO_PROGRESS_FLOPS = 1e11     # progress=None reports on a terminal only for searches at least this big


# ---------------------------------------------------------------------------------------------------------------
# Calibration statistics

class CalibrationStats(NamedTuple):
    """What the searches need from the calibration input ``x [T, K]`` (float32, numpy or CuPy).

    ``x_abs_mean [K]`` = mean over tokens of ``|x|``; ``gram [K, K]`` = ``X^T X / T``; ``n_tokens`` = T used.
    """

    x_abs_mean: Any
    gram: Any
    n_tokens: int

    @property
    def in_features(self) -> int:
        return int(self.x_abs_mean.shape[0])

    def scaled(self, scales) -> "CalibrationStats":
        """The statistics of ``x / scales`` (the input the scaled weight ``W diag(scales)`` sees)."""
        s = _check_scales(scales, self.in_features, get_xp(self.gram))
        return CalibrationStats(self.x_abs_mean / s, self.gram / (s[:, None] * s[None, :]), self.n_tokens)


def _is_array(a) -> bool:
    return hasattr(a, "ndim") and hasattr(a, "dtype") and hasattr(a, "shape")


def _check_float(a, what: str):
    if not (a.dtype.kind == "f" or is_bfloat16(a.dtype)):
        raise TypeError(f"{what} must be a float array (float16/float32/float64/bfloat16), got dtype {a.dtype}")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def _seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    return int(seed)


def _calibration_chunks(x_calib, K: int | None):
    """x_calib (array or list of arrays) -> list of 2-D [rows, K] views, the array module, K."""
    if _is_array(x_calib):
        parts = [x_calib]
    elif isinstance(x_calib, Sequence) and not isinstance(x_calib, (str, bytes)) and len(x_calib) > 0 \
            and all(_is_array(p) for p in x_calib):
        parts = list(x_calib)
    else:
        raise TypeError("x_calib must be a numpy/cupy array [..., K], a non-empty list of such arrays, or "
                        f"CalibrationStats; got {type(x_calib).__name__}")
    xp = get_xp(*parts)
    chunks = []
    for i, p in enumerate(parts):
        what = "x_calib" if len(parts) == 1 else f"x_calib[{i}]"
        _check_float(p, what)
        if p.ndim < 2:
            raise ValueError(f"{what} must be at least 2-D [..., K] (tokens, in_features); got shape {tuple(p.shape)}")
        if K is None:
            K = int(p.shape[-1])
        if int(p.shape[-1]) != K:
            raise ValueError(f"{what} has {int(p.shape[-1])} input features (last dim), expected K={K}")
        chunks.append(p.reshape(-1, K))
    return chunks, xp, K


def calibration_stats(x_calib, *, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0,
                      in_features: int | None = None) -> CalibrationStats:
    """``mean|x|`` and ``X^T X / T`` of the calibration input, streamed in blocks (see the module docstring).

    ``x_calib``: an array ``[..., K]`` (all leading dims are tokens) or a list of them, numpy or CuPy, any float
    dtype. At most ``max_tokens`` rows are used, drawn deterministically from ``seed`` when there are more.
    ``in_features``: the expected K (checked). Passing a ``CalibrationStats`` returns it (after the K check).
    """
    max_tokens = _positive_int(max_tokens, "max_tokens")
    seed = _seed(seed)
    if isinstance(x_calib, CalibrationStats):
        if in_features is not None and x_calib.in_features != in_features:
            raise ValueError(f"calibration statistics are for K={x_calib.in_features}, expected K={in_features}")
        return x_calib
    chunks, xp, K = _calibration_chunks(x_calib, in_features)
    sizes = [int(c.shape[0]) for c in chunks]
    total = sum(sizes)
    if total == 0:
        raise ValueError("x_calib holds no calibration rows (tokens)")
    block = max(1, _BLOCK_X // K)
    picked = None
    if total > max_tokens:
        picked = np.sort(np.random.default_rng(seed).choice(total, size=max_tokens, replace=False))
    gram = xp.zeros((K, K), dtype=np.float32)
    abs_sum = xp.zeros((K,), dtype=np.float32)
    start = 0
    for c, n in zip(chunks, sizes):
        if picked is None:
            blocks = (c[lo:lo + block] for lo in range(0, n, block))
        else:
            mine = picked[np.searchsorted(picked, start):np.searchsorted(picked, start + n)] - start
            blocks = (c[xp.asarray(mine[lo:lo + block])] for lo in range(0, len(mine), block))
        for xb in blocks:
            xb = xb.astype(np.float32)
            gram += xb.T @ xb
            abs_sum += xp.abs(xb).sum(axis=0)
        start += n
    used = total if picked is None else max_tokens
    if not bool(xp.isfinite(gram).all()):
        raise ValueError("x_calib holds non-finite values (NaN/inf), or values whose squares overflow float32")
    return CalibrationStats(abs_sum / np.float32(used), gram / np.float32(used), used)


# ---------------------------------------------------------------------------------------------------------------
# Validation helpers

def _check_weights(weights, what: str = "weights"):
    """A 2-D weight or a non-empty list of them sharing K -> (list of float32 arrays [N_i, K], xp, K)."""
    if _is_array(weights):
        weights = [weights]
    if not isinstance(weights, Sequence) or isinstance(weights, (str, bytes)) or not weights \
            or not all(_is_array(w) for w in weights):
        raise TypeError(f"{what} must be a 2-D numpy/cupy array [N, K] or a non-empty list of them")
    xp = get_xp(*weights)
    K = None
    out = []
    for i, w in enumerate(weights):
        name = what if len(weights) == 1 else f"{what}[{i}]"
        _check_float(w, name)
        if w.ndim != 2 or 0 in w.shape:
            raise ValueError(f"{name} must be a non-empty 2-D [out_features, in_features] array, "
                             f"got shape {tuple(w.shape)}")
        if K is None:
            K = int(w.shape[1])
        if int(w.shape[1]) != K:
            raise ValueError(f"{name} has in_features {int(w.shape[1])}, but the first weight has K={K}: "
                             "layers searched together must share their input")
        w32 = w.astype(np.float32)
        if not bool(xp.isfinite(w32).all()):
            raise ValueError(f"{name} holds non-finite values (NaN/inf)")
        out.append(w32)
    return out, xp, K


def _check_weight(weight, what: str = "weight"):
    """One 2-D weight -> (float32 array [N, K], xp, K)."""
    if not _is_array(weight):
        raise TypeError(f"{what} must be a 2-D numpy/cupy array [N, K], got {type(weight).__name__}")
    (w,), xp, K = _check_weights([weight], what)
    return w, xp, K


def _check_scales(scales, K: int, xp):
    if not _is_array(scales):
        raise TypeError(f"scales must be a numpy/cupy array [K], got {type(scales).__name__}")
    if get_xp(scales) is not xp:
        raise TypeError("scales and the other inputs mix numpy and cupy arrays; pass all of them on the same side")
    if scales.ndim != 1 or int(scales.shape[0]) != K:
        raise ValueError(f"scales must have shape ({K},), got {tuple(scales.shape)}")
    _check_float(scales, "scales")
    s = scales.astype(np.float32)
    if not bool((xp.isfinite(s) & (s > 0)).all()):
        raise ValueError("scales must be finite and > 0")
    return s


def _check_grid(n_grid) -> int:
    return _positive_int(n_grid, "n_grid")


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _same_side(xp, stats: CalibrationStats):
    if get_xp(stats.gram) is not xp:
        raise TypeError("weights and calibration data mix numpy and cupy arrays; pass all of them on the same side")


def _reporter(progress, work_flops: float) -> Callable[[int, int, str], None] | None:
    """``progress``: None (report on a terminal when the job is big), False, True (stderr), or a callable
    ``(done, total, description)``."""
    return make_reporter(progress, work_flops >= _AUTO_PROGRESS_FLOPS)


# ---------------------------------------------------------------------------------------------------------------
# The core: fake quantization (bit-identical to quantize(...).dequantize(float32)) and the losses

def _fake_quant(xp, w3, zero_point: bool):
    """RTN of float32 groups ``w3 [..., G]`` with ``quantize``'s float32 semantics, dequantized to float32."""
    f = np.float32
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        if zero_point:
            hi = w3.max(axis=-1, keepdims=True)
            lo = w3.min(axis=-1, keepdims=True)
            s = (xp.maximum(hi - lo, f(_MIN_RANGE)) / f(_MAX_Q)).astype(np.float16).astype(np.float32)
            z = xp.clip(-xp.round(lo / s), f(0), f(_MAX_Q))
            q = xp.clip(xp.round(w3 / s) + z, f(0), f(_MAX_Q))
            return (q - z) * s
        amax = xp.abs(w3).max(axis=-1, keepdims=True)
        s = (xp.maximum(amax, f(_MIN_RANGE)) / f(_SYM_MAX)).astype(np.float16).astype(np.float32)
        return xp.clip(xp.round(w3 / s), f(_SYM_MIN), f(_SYM_MAX)) * s


def _row_blocks(N: int, K: int):
    rows = max(1, _BLOCK_W // K)
    return [(lo, min(lo + rows, N)) for lo in range(0, N, rows)]


def _quadratic(xp, d, gram) -> float:
    """sum_n d_n^T C d_n for d [n, K] (float32 accumulation, returned as a Python float)."""
    return float(((d @ gram) * d).sum(dtype=np.float64))


def _w_mean(xp, weights, G: int):
    """AutoAWQ's weight term: per group |w| / max|w|, averaged over every output row of every layer -> [K]."""
    K = weights[0].shape[1]
    total = xp.zeros((K,), dtype=np.float32)
    n = 0
    for w in weights:
        a = xp.abs(w).reshape(w.shape[0], K // G, G)
        total += (a / (a.max(axis=-1, keepdims=True) + np.float32(_W_MEAN_EPS))).reshape(-1, K).sum(axis=0)
        n += w.shape[0]
    return total / np.float32(n)


def _candidate_scales(xp, x_abs_mean, w_mean, alpha: float):
    f = np.float32
    s = xp.maximum(x_abs_mean ** f(alpha), f(_MIN_SCALE))
    if w_mean is not None:
        s = xp.maximum(s / (w_mean ** f(1 - alpha) + f(_MIN_SCALE)), f(_MIN_SCALE))
    return (s / xp.sqrt(s.max() * s.min())).astype(np.float32)


def _scaled_loss(xp, weights, gram, s, G: int, zero_point: bool) -> float:
    """Mean squared output error of RTN(W diag(s)) diag(1/s) against W, over all layers' outputs."""
    K = gram.shape[0]
    total, n_out = 0.0, 0
    for w in weights:
        N = w.shape[0]
        for lo, hi in _row_blocks(N, K):
            wb = w[lo:hi]
            ws = (wb * s).reshape(hi - lo, K // G, G)
            d = _fake_quant(xp, ws, zero_point).reshape(hi - lo, K) / s - wb
            total += _quadratic(xp, d, gram)
        n_out += N
    return total / n_out


def scale_losses(weights, x_calib, alphas, *, group_size: int = 128, duo_scaling: bool = False,
                 zero_point: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0):
    """The search's loss for each ``alpha`` in ``alphas``: mean squared output error of the layers (numpy float64).

    Same arguments as ``search_scales``; ``alphas`` is any sequence of numbers in [0, 1].
    """
    ws, xp, K = _check_weights(weights)
    G = resolve_group_size(group_size, K)
    _check_bool(duo_scaling, "duo_scaling")
    _check_bool(zero_point, "zero_point")
    stats = calibration_stats(x_calib, max_tokens=max_tokens, seed=seed, in_features=K)
    _same_side(xp, stats)
    alphas = [float(a) for a in alphas]
    if not alphas or not all(0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must be a non-empty sequence of numbers in [0, 1], got {alphas}")
    w_mean = _w_mean(xp, ws, G) if duo_scaling else None
    return np.array([_scaled_loss(xp, ws, stats.gram, _candidate_scales(xp, stats.x_abs_mean, w_mean, a), G,
                                  zero_point) for a in alphas])


def _search_scales(ws, xp, K, stats, G, n_grid, duo_scaling, zero_point, report):
    w_mean = _w_mean(xp, ws, G) if duo_scaling else None
    best, best_alpha, best_s = math.inf, None, None
    losses = np.full(n_grid, np.nan)
    for i in range(n_grid):
        alpha = i / n_grid
        s = _candidate_scales(xp, stats.x_abs_mean, w_mean, alpha)
        loss = _scaled_loss(xp, ws, stats.gram, s, G, zero_point)
        losses[i] = loss
        if math.isfinite(loss) and loss < best:
            best, best_alpha, best_s = loss, alpha, s
        if report:
            report(i + 1, n_grid, "AWQ scale search, alpha")
    if best_s is None:
        raise ValueError("every candidate scaling gives a non-finite error; the weights' group ranges are too "
                         "large for float16 quantization scales")
    return best_s, best_alpha, losses


def search_scales(weights, x_calib, *, group_size: int = 128, n_grid: int = 20, duo_scaling: bool = False,
                  zero_point: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0, progress=None):
    """AWQ per-input-channel scales ``s [K]`` (float32) for the layers ``weights`` that read ``x_calib``.

    ``weights``: one ``[N, K]`` (nn.Linear layout) array or a list of them sharing K. ``x_calib``: ``[..., K]``,
    a list of such arrays, or ``CalibrationStats``. ``group_size``: -1 or a divisor of K that is a multiple of 8.
    Grid: ``alpha = i / n_grid`` for ``i < n_grid``. See the module docstring for the loss and the memory cap.
    The scaled layers compute ``(x / s) @ (W diag(s))^T``; quantize ``W diag(s)`` and fold ``1/s`` upstream.
    """
    ws, xp, K = _check_weights(weights)
    G = resolve_group_size(group_size, K)
    n_grid = _check_grid(n_grid)
    _check_bool(duo_scaling, "duo_scaling")
    _check_bool(zero_point, "zero_point")
    stats = calibration_stats(x_calib, max_tokens=max_tokens, seed=seed, in_features=K)
    _same_side(xp, stats)
    report = _reporter(progress, 2.0 * n_grid * sum(w.shape[0] for w in ws) * K * K)
    return _search_scales(ws, xp, K, stats, G, n_grid, duo_scaling, zero_point, report)[0]


# ---------------------------------------------------------------------------------------------------------------
# Clipping

class ClipRange(NamedTuple):
    """Per (output channel, group) clamp bounds, float32 ``[N, K/G]`` each: ``min_val <= w <= max_val``."""

    max_val: Any
    min_val: Any


def _group_ranges(xp, w3, zero_point: bool):
    if zero_point:
        return w3.max(axis=-1), w3.min(axis=-1)
    amax = xp.abs(w3).max(axis=-1)
    return amax, -amax


def _diag_blocks(xp, gram, G: int):
    NG = gram.shape[0] // G
    return xp.stack([gram[g * G:(g + 1) * G, g * G:(g + 1) * G] for g in range(NG)])   # [NG, G, G]


def _search_clip(xp, w, stats, G, n_grid, max_shrink, zero_point, report):
    N, K = w.shape
    NG = K // G
    blocks = _diag_blocks(xp, stats.gram, G)
    steps = max(1, int(max_shrink * n_grid))
    max_val = xp.empty((N, NG), dtype=np.float32)
    min_val = xp.empty((N, NG), dtype=np.float32)
    parts = _row_blocks(N, K)
    done = 0
    for lo, hi in parts:
        w3 = w[lo:hi].reshape(hi - lo, NG, G)
        top, bottom = _group_ranges(xp, w3, zero_point)
        best_err = xp.full((hi - lo, NG), xp.inf, dtype=np.float32)
        best_top, best_bottom = top.copy(), bottom.copy()
        for i in range(steps):
            r = np.float32(1 - i / n_grid)
            t, b = top * r, bottom * r
            cur = xp.minimum(xp.maximum(w3, b[..., None]), t[..., None])
            d = (_fake_quant(xp, cur, zero_point) - w3).transpose(1, 0, 2)            # [NG, n, G]
            err = ((d @ blocks) * d).sum(axis=-1).T                                    # [n, NG]
            better = err < best_err
            best_err = xp.where(better, err, best_err)
            best_top = xp.where(better, t, best_top)
            best_bottom = xp.where(better, b, best_bottom)
            done += 1
            if report:
                report(done, steps * len(parts), "AWQ clip search, step")
        max_val[lo:hi] = best_top
        min_val[lo:hi] = best_bottom
    return ClipRange(max_val, min_val)


def _check_shrink(max_shrink) -> float:
    if isinstance(max_shrink, bool) or not isinstance(max_shrink, (int, float, np.floating)) \
            or not 0.0 <= float(max_shrink) < 1.0:
        raise ValueError(f"max_shrink={max_shrink!r} must be a number in [0, 1)")
    return float(max_shrink)


def search_clip(weight, x_calib, *, group_size: int = 128, n_grid: int = 20, max_shrink: float = 0.5,
                zero_point: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0,
                progress=None) -> ClipRange:
    """Per-group clamp ranges of ``weight [N, K]`` that minimise the output error on ``x_calib``.

    Pass the weight and the input as the quantized layer will see them: after scaling, ``W diag(s)`` and
    ``x / s`` (``stats.scaled(s)``). Shrink factors ``1 - i/n_grid`` for ``i < int(max_shrink * n_grid)``
    (at least ``i = 0``, no clipping). Each (channel, group) is scored by the mean squared error of its partial
    dot product with the calibration tokens. Returns float32 ``ClipRange(max_val, min_val)``, ``[N, K/G]``.
    """
    w, xp, K = _check_weight(weight)
    G = resolve_group_size(group_size, K)
    n_grid = _check_grid(n_grid)
    max_shrink = _check_shrink(max_shrink)
    _check_bool(zero_point, "zero_point")
    stats = calibration_stats(x_calib, max_tokens=max_tokens, seed=seed, in_features=K)
    _same_side(xp, stats)
    report = _reporter(progress, 2.0 * max(1, int(max_shrink * n_grid)) * w.shape[0] * K * G)
    return _search_clip(xp, w, stats, G, n_grid, max_shrink, zero_point, report)


def quantize_clipped(weight, clip: ClipRange | None, *, group_size: int = 128,
                     zero_point: bool = True) -> QuantizedTensors:
    """``awq_cupy.quantize`` of ``weight [N, K]`` clamped per group to ``clip`` (None: plain RTN).

    The quantized ranges are then exactly the clip ranges (or narrower where a group lies inside them).
    The weight is converted to float32 first (``quantize``'s float32 semantics: scales rounded to float16).
    """
    w, xp, K = _check_weight(weight)
    G = resolve_group_size(group_size, K)
    if clip is not None:
        if not isinstance(clip, ClipRange):
            raise TypeError(f"clip must be a ClipRange (from search_clip) or None, got {type(clip).__name__}")
        N, NG = w.shape[0], K // G
        for name, v in zip(ClipRange._fields, clip):
            if not _is_array(v) or get_xp(v) is not xp:
                raise TypeError(f"clip.{name} must be an array on the same side (numpy/cupy) as the weight")
            if tuple(v.shape) != (N, NG):
                raise ValueError(f"clip.{name} has shape {tuple(v.shape)}, expected (N, K/G) = {(N, NG)}")
        top = clip.max_val.astype(np.float32)[..., None]
        bottom = clip.min_val.astype(np.float32)[..., None]
        if not bool((bottom <= top).all()):
            raise ValueError("clip.min_val must not exceed clip.max_val")
        w = xp.minimum(xp.maximum(w.reshape(N, NG, G), bottom), top).reshape(N, K)
    return quantize(w, group_size=G, zero_point=zero_point)


# ---------------------------------------------------------------------------------------------------------------
# The whole recipe for one input

class AWQResult(NamedTuple):
    """``layers[i]`` quantizes ``weights[i] diag(scales)``; divide the input by ``scales`` (fold it upstream).

    ``alpha`` is the chosen exponent; ``losses[i]`` the calibration loss at ``alpha = i / n_grid`` (numpy).
    ``clips[i]`` is the ``ClipRange`` used for layer i, or None where clipping was off.
    """

    layers: list
    scales: Any
    alpha: float
    losses: Any
    clips: list


def quantize_awq(weights, x_calib, *, group_size: int = 128, n_grid: int = 20, max_shrink: float = 0.5,
                 clip=True, duo_scaling: bool = False, zero_point: bool = True,
                 max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0, progress=None) -> AWQResult:
    """Activation-aware 4-bit quantization of the layers ``weights`` (list of ``[N_i, K]``) that read ``x_calib``.

    Scale search, then (where ``clip`` allows) clip search on the scaled weights and inputs, then RTN of the
    clamped ``W diag(s)``. ``clip``: a bool for all layers or a list of bools, one per layer (AutoAWQ skips
    clipping for attention query/key projections, whose errors are multiplied together in the logits).
    Returns ``AWQResult``; ``awq_cupy.save_checkpoint`` writes ``result.layers`` as AutoAWQ ``gemm``.
    """
    ws, xp, K = _check_weights(weights)
    G = resolve_group_size(group_size, K)
    n_grid = _check_grid(n_grid)
    max_shrink = _check_shrink(max_shrink)
    _check_bool(duo_scaling, "duo_scaling")
    _check_bool(zero_point, "zero_point")
    if isinstance(clip, bool):
        clips_on = [clip] * len(ws)
    elif isinstance(clip, Sequence) and len(clip) == len(ws) and all(isinstance(c, bool) for c in clip):
        clips_on = list(clip)
    else:
        raise TypeError(f"clip must be a bool or a list of {len(ws)} bools (one per weight), got {clip!r}")
    for i, w in enumerate(ws):
        if w.shape[0] % 8:
            raise ValueError(f"weights[{i}] has out_features N={w.shape[0]}, not a multiple of 8 (needed for packing)")
    stats = calibration_stats(x_calib, max_tokens=max_tokens, seed=seed, in_features=K)
    _same_side(xp, stats)
    n_rows = sum(w.shape[0] for w in ws)
    steps = max(1, int(max_shrink * n_grid))
    report = _reporter(progress, 2.0 * n_rows * K * (n_grid * K + steps * G))

    scales, alpha, losses = _search_scales(ws, xp, K, stats, G, n_grid, duo_scaling, zero_point, report)
    scaled_stats = stats.scaled(scales)
    layers, clips = [], []
    for w, on in zip(ws, clips_on):
        ws_i = w * scales
        cr = _search_clip(xp, ws_i, scaled_stats, G, n_grid, max_shrink, zero_point, report) if on else None
        layers.append(quantize_clipped(ws_i, cr, group_size=G, zero_point=zero_point))
        clips.append(cr)
    return AWQResult(layers=layers, scales=scales, alpha=alpha, losses=losses, clips=clips)


# ---------------------------------------------------------------------------------------------------------------
# Folding 1/s into the previous operation

def _fold_dtype(a):
    return a.dtype if a.dtype.kind == "f" or is_bfloat16(a.dtype) else np.dtype(np.float32)


def fold_scales_into_norm(norm_weight, norm_bias, scales):
    """``(norm_weight / s, norm_bias / s)``: a LayerNorm (or RMSNorm, ``norm_bias=None``) whose output is ``x / s``.

    Valid when the norm's output feeds only the scaled layers (pre-norm transformers). Not for norms whose
    output is also the residual stream (post-norm models such as BERT), and not for Gemma-style ``(1 + w)``
    norms. Returns new arrays in the input dtypes (computed in float32); the bias is None when ``norm_bias`` is.
    """
    if not _is_array(norm_weight) or norm_weight.ndim != 1:
        raise ValueError("norm_weight must be a 1-D array [K]")
    _check_float(norm_weight, "norm_weight")
    xp = get_xp(norm_weight, norm_bias, scales)
    K = int(norm_weight.shape[0])
    s = _check_scales(scales, K, xp)
    w = (norm_weight.astype(np.float32) / s).astype(_fold_dtype(norm_weight))
    return w, _fold_bias(norm_bias, s, "norm_bias")


def _fold_bias(bias, s, name):
    """``bias / s`` in the bias's dtype (computed in float32), or None; ``bias`` must match ``s``'s length."""
    if bias is None:
        return None
    n = int(s.shape[0])
    if not _is_array(bias) or tuple(bias.shape) != (n,):
        raise ValueError(f"{name} must be None or an array of shape ({n},)")
    _check_float(bias, name)
    return (bias.astype(np.float32) / s).astype(_fold_dtype(bias))


def fold_scales_into_linear(prev_weight, prev_bias, scales):
    """``(prev_weight / s[:, None], prev_bias / s)``: divide the output channels of the previous linear by ``s``.

    ``prev_weight [N_prev, K_prev]`` (nn.Linear layout) produces the input of the scaled layers, so
    ``N_prev == K`` of those layers, and only channel-wise operations may sit in between (e.g. v_proj -> the
    attention-weighted sum -> o_proj). Returns new arrays in the input dtypes (computed in float32).
    """
    if not _is_array(prev_weight) or prev_weight.ndim != 2:
        raise ValueError("prev_weight must be a 2-D array [N_prev, K_prev]")
    _check_float(prev_weight, "prev_weight")
    xp = get_xp(prev_weight, prev_bias, scales)
    N = int(prev_weight.shape[0])
    s = _check_scales(scales, N, xp)
    w = (prev_weight.astype(np.float32) / s[:, None]).astype(_fold_dtype(prev_weight))
    return w, _fold_bias(prev_bias, s, "prev_bias")


# ---------------------------------------------------------------------------------------------------------------
# Measuring

def output_mse(weight, weight_hat, x_calib, *, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0) -> float:
    """Mean squared error of the layer outputs ``x @ weight_hat^T`` against ``x @ weight^T`` (both ``[N, K]``).

    For an AWQ layer, ``weight_hat`` is ``result.layers[i].fake_quant(np.float32) / result.scales``.
    """
    w, xp, K = _check_weight(weight)
    w_hat, xp_hat, _ = _check_weight(weight_hat, "weight_hat")
    if xp_hat is not xp:
        raise TypeError("weight and weight_hat mix numpy and cupy arrays; pass both on the same side")
    if w.shape != w_hat.shape:
        raise ValueError(f"weight {tuple(w.shape)} and weight_hat {tuple(w_hat.shape)} differ in shape")
    stats = calibration_stats(x_calib, max_tokens=max_tokens, seed=seed, in_features=K)
    _same_side(xp, stats)
    total = sum(_quadratic(xp, w_hat[lo:hi] - w[lo:hi], stats.gram) for lo, hi in _row_blocks(w.shape[0], K))
    return total / w.shape[0]
