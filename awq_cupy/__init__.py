"""awq_cupy: AWQ 4-bit (W4A16) GEMM/GEMV for CuPy arrays, without PyTorch.

Data path: checkpoint (``load_checkpoint``) -> formats (``formats.unpack/to_gemm``) -> ``QuantizedWeight``
(repacked once on the GPU) -> ``matmul`` (tensor-core kernels in ``kernels_cu/``; launch plans made once per call
shape) -> ``bind`` for the tightest loops, ``capture`` for a whole step as a CUDA graph.

Importing this package compiles nothing, queries no device and does not import CuPy.
"""
from importlib.metadata import PackageNotFoundError, version as _version

from . import awq, formats, layout, reference, settings, sharding
from .awq import (AWQResult, calibration_stats, fold_scales_into_linear, fold_scales_into_norm, quantize_awq,
                  search_clip, search_scales)
from ._array import GPUUnavailableError
from .checkpoint import (Checkpoint, CheckpointError, CheckpointWarning, PendingLayer, QuantizedLayer, load_checkpoint,
                         save_checkpoint)
from .loading import DEFAULT_FUSE_RULES, FuseRule, Part
from .graphs import CapturedStep, capture
from .ops import BoundMatmul, bind, dequantize, dequantize_gemm, gemm, matmul
from .quantize import QuantizedTensors, quantize
from .weight import QuantizedWeight

try:
    __version__ = _version("awq_cupy")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["QuantizedWeight", "matmul", "bind", "BoundMatmul", "capture", "CapturedStep", "settings", "gemm",
           "dequantize", "dequantize_gemm", "quantize", "QuantizedTensors",
           "load_checkpoint", "save_checkpoint", "Checkpoint", "QuantizedLayer", "CheckpointError", "CheckpointWarning",
           "PendingLayer", "FuseRule", "Part", "DEFAULT_FUSE_RULES", "GPUUnavailableError", "formats",
           "layout", "reference", "awq", "quantize_awq", "search_scales", "search_clip", "fold_scales_into_norm",
           "fold_scales_into_linear", "calibration_stats", "AWQResult", "sharding", "__version__"]
