"""awq_cupy: AWQ 4-bit (W4A16) GEMM/GEMV for CuPy arrays, without PyTorch.

Importing this package compiles nothing, queries no device and does not import CuPy.
"""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("awq_cupy")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
