"""Array-module helpers shared by the numpy/cupy-agnostic code (formats, quantizer, reference).

Nothing here imports CuPy at module import time: ``import awq_cupy`` must work (and stay cheap) on a machine
without a GPU or without CuPy at all.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["get_xp", "is_cupy", "to_numpy", "bfloat16_dtype", "is_bfloat16", "gpu_available", "GPUUnavailableError",
           "no_gpu_message", "require_gpu", "make_reporter"]


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
_NO_GPU_REASON = ""


class GPUUnavailableError(RuntimeError):
    """A call that runs on a CUDA GPU was made where none is usable (no CuPy, no driver, no device)."""


def _probe_gpu() -> tuple[bool, str]:
    """(usable, why not). Tells apart the causes a user can act on: no CuPy, no CUDA device or driver, and a
    driver older than the CUDA runtime CuPy was built for."""
    try:
        import cupy
    except Exception as e:      # ImportError, or a CuPy wheel that does not match this CUDA / Python
        return False, f"CuPy does not import: {e}; install the CUDA extra, e.g. pip install -e \".[cuda13]\""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        text = str(e)
        if "InsufficientDriver" in text:
            # the CUDA runtime says "driver insufficient" also when there is no driver at all: tell the two apart
            if not _driver_library_loads():
                return False, "cupy.cuda.is_available() is False: no NVIDIA driver here (libcuda does not load)"
            return False, f"cupy.cuda.is_available() is False: the NVIDIA driver is older than CuPy's CUDA ({text})"
        return False, f"cupy.cuda.is_available() is False ({text})"
    if n <= 0:
        return False, "cupy.cuda.is_available() is False: no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    return True, ""


def _driver_library_loads() -> bool:
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers. Cached; never raises."""
    global _GPU_AVAILABLE, _NO_GPU_REASON
    if _GPU_AVAILABLE is None:
        try:
            _GPU_AVAILABLE, _NO_GPU_REASON = _probe_gpu()
        except Exception as e:  # never let the probe itself raise
            _GPU_AVAILABLE, _NO_GPU_REASON = False, f"the GPU probe failed: {e}"
    return _GPU_AVAILABLE


def no_gpu_message(what: str) -> str:
    """``"<what> needs a CUDA GPU: none is available here (<why>)."``: the one wording every entry point and the
    ``bench``/``tune`` commands use."""
    gpu_available()
    return f"{what} needs a CUDA GPU: none is available here ({_NO_GPU_REASON or 'no CUDA device'})."


_CPU_ROUTES = ("On the CPU: awq_cupy.dequantize(layer) of a checkpoint layer or of quantize()'s result gives the "
               "dense weight as numpy, and awq_cupy.reference.matmul / matmul_packed compute x @ W in numpy.")


def require_gpu(what: str) -> None:
    """Raise ``GPUUnavailableError`` naming ``what`` (and the CPU routes) when no CUDA GPU is usable. Cheap after
    the first call (the probe is cached)."""
    if not gpu_available():
        raise GPUUnavailableError(f"{no_gpu_message(what)} {_CPU_ROUTES}")


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
