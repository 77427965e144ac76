"""The activation dtypes awq_cupy serves (float16, bfloat16) and their spellings: shared by the weight, the ops and
the formats, and imported by nothing of ours but ``_array``."""
from __future__ import annotations

import numpy as np

from ._array import bfloat16_dtype

__all__ = ["dtype_name", "numpy_dtype", "activation_dtype", "BF16_NOTE"]

BF16_NOTE = ("bfloat16 needs ml_dtypes (pip install ml_dtypes) for a typed array; without it pass "
             "dtype='bfloat16' and use uint16 arrays holding bf16 bit patterns")


def dtype_name(dtype) -> str:
    """'float16' or 'bfloat16' for the accepted spellings (np.float16, 'float16', 'half', ml_dtypes.bfloat16,
    'bfloat16', 'bf16'); TypeError otherwise."""
    if isinstance(dtype, str):
        s = dtype.lower()
        if s in ("float16", "half", "fp16", "f16"):
            return "float16"
        if s in ("bfloat16", "bf16"):
            return "bfloat16"
        raise TypeError(f"dtype={dtype!r} is not supported; use float16 or bfloat16")
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype={dtype!r} is not supported; use float16 or bfloat16") from None
    if d == np.float16:
        return "float16"
    bf = bfloat16_dtype()
    if bf is not None and d == bf:
        return "bfloat16"
    raise TypeError(f"dtype={d} is not supported; use float16 or bfloat16")


def numpy_dtype(name: str):
    """The array dtype used to hold ``name`` ('float16' or 'bfloat16'); bf16 is uint16 without ml_dtypes."""
    if name == "float16":
        return np.dtype(np.float16)
    bf = bfloat16_dtype()
    return bf if bf is not None else np.dtype(np.uint16)


def activation_dtype(a, what: str, dtype=None) -> str:
    """The 16-bit float kind of array ``a``: its own dtype (float16 / ml_dtypes bfloat16), or ``dtype`` when
    ``a`` holds raw uint16 bf16 bits."""
    if a.dtype == np.uint16:
        if dtype is None or dtype_name(dtype) != "bfloat16":
            raise TypeError(f"{what} has dtype uint16; pass dtype='bfloat16' if it holds bf16 bit patterns")
        return "bfloat16"
    name = dtype_name(a.dtype) if a.dtype in (np.float16, bfloat16_dtype()) else None
    if name is None:
        raise TypeError(f"{what} has dtype {a.dtype}; expected float16 or bfloat16 ({BF16_NOTE})")
    if dtype is not None and dtype_name(dtype) != name:
        raise TypeError(f"{what} has dtype {a.dtype} but dtype={dtype!r} was requested")
    return name
