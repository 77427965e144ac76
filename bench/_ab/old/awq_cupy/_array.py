"""Array-module helpers shared by the numpy/cupy-agnostic code (formats, quantizer, reference).

Nothing here imports CuPy at module import time: ``import awq_cupy`` must work (and stay cheap) on a machine
without a GPU or without CuPy at all.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["get_xp", "is_cupy", "to_numpy", "bfloat16_dtype", "is_bfloat16", "gpu_available", "make_reporter"]


def is_cupy(a) -> bool:
    """True when ``a`` is a CuPy array (checked without importing CuPy)."""
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(a, cp.ndarray)


def get_xp(*arrays):
    """The array module (numpy or cupy) of the inputs; mixing the two is a TypeError."""
    mods = {is_cupy(a) for a in arrays if a is not None}
    if len(mods) > 1:
        raise TypeError("inputs mix numpy and cupy arrays; pass all of them on the same side")
    if mods == {True}:
        import cupy

        return cupy
    return np


def to_numpy(a):
    """Host copy of a numpy or cupy array (numpy arrays are returned as they are)."""
    return a.get() if is_cupy(a) else np.asarray(a)


def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` when ml_dtypes is installed, else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    bf = bfloat16_dtype()
    return bf is not None and np.dtype(dtype) == bf


_GPU_AVAILABLE = None


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers. Cached; never raises."""
    global _GPU_AVAILABLE
    if _GPU_AVAILABLE is None:
        try:
            import cupy

            _GPU_AVAILABLE = bool(cupy.cuda.is_available()) and cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            _GPU_AVAILABLE = False
    return _GPU_AVAILABLE


def make_reporter(progress, big: bool):
    """A progress callback ``(done, total, description)`` from a ``progress`` option: a callable is used as it
    is; True prints to stderr; False reports nothing; None prints only when stderr is a terminal and the job is
    ``big``."""
    if callable(progress) and not isinstance(progress, bool):
        return progress
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, a bool or a callable, got {type(progress).__name__}")
    show = progress if progress is not None else (sys.stderr.isatty() and big)
    if not show:
        return None

    def report(done: int, total: int, desc: str):
        sys.stderr.write(f"\r[awq_cupy] {desc} {done}/{total}" + ("\n" if done >= total else ""))
        sys.stderr.flush()

    return report
