"""Other W4A16 libraries as optional benchmark contenders (``bench --contenders ... humming``).

A peer is never a dependency: it is imported only when asked for, and when it (or torch) does not import the
benchmark prints why and leaves it out. A peer is fed the same AutoAWQ ``gemm`` tensors as awq_cupy's copy of
the layer, so both multiply the same weights; its output goes into the benchmark's own output array and is
validated like awq_cupy's before it is timed.

torch and CuPy share the arrays through DLPack (no copies) and the stream: the peer's calls are made inside
``torch.cuda.stream`` of the caller's current CuPy stream, so the benchmark's spin kernel and events bracket them
exactly as they bracket awq_cupy's calls.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]) as numpy arrays, AutoAWQ ``gemm`` packing
GemmTensors = tuple[np.ndarray, np.ndarray, np.ndarray]
# call(i, x, y): y = x @ W of copy i % copies, for CuPy arrays x [M, K] and y [M, N] of the layer's dtype
PeerCall = Callable[[int, object, object], None]


@dataclass(frozen=True)
class Peer:
    name: str
    package: str          # the PyPI name, for the "not installed" reason
    module: str           # what is imported
    build: Callable[[Sequence[GemmTensors], int, int, int, str], PeerCall]   # (copies, K, N, G, dtype) -> call

    def __post_init__(self):
        if not callable(self.build):
            raise TypeError(f"Peer {self.name!r}: build must be callable, got {type(self.build).__name__}")

    def unavailable(self) -> str | None:
        """Why this peer cannot run here (None when it can)."""
        try:
            import torch
        except Exception as e:   # ImportError, or a torch whose own CUDA libraries fail to load
            return f"torch does not import ({type(e).__name__}: {e})"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        try:
            __import__(self.module)
        except Exception as e:
            return f"{self.module} does not import ({type(e).__name__}: {e}); pip install {self.package}"
        return None

    def prepare(self, copies: Sequence[GemmTensors], K: int, N: int, group_size: int, dtype: str) -> PeerCall:
        """The peer's layer for every weight copy, loaded and transformed once; returns the call."""
        return self.build(copies, K, N, group_size, dtype)


def _torch_stream():
    """torch's view of the caller's current CuPy stream."""
    import cupy
    import torch

    ptr = cupy.cuda.get_current_stream().ptr
    return torch.cuda.ExternalStream(ptr) if ptr else torch.cuda.default_stream()


def _humming(copies, K, N, group_size, dtype) -> PeerCall:
    import torch
    from humming.layer import HummingLayer

    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True}
    layers = []
    with torch.cuda.stream(_torch_stream()):
        for qweight, qzeros, scales in copies:
            layer = HummingLayer(shape_n=N, shape_k=K, torch_dtype=tdtype, weight_config=dict(config)).cuda()
            layer.load_from_tensors({"qweight": torch.from_numpy(qweight).cuda(),
                                     "qzeros": torch.from_numpy(qzeros).cuda(),
                                     "scales": torch.from_numpy(scales).cuda().to(tdtype)})
            layer.transform()
            layers.append(layer)
    torch.cuda.synchronize()
    n = len(layers)
    last: list = [None, None]   # (x, y) -> torch views of the arrays last called with: a timed call converts nothing

    def call(i, x, y):
        if last[0] != (x.data.ptr, y.data.ptr, x.shape, y.shape):
            last[:] = [(x.data.ptr, y.data.ptr, x.shape, y.shape),
                       (torch.from_dlpack(x), torch.from_dlpack(y), _torch_stream())]
        tx, ty, stream = last[1]
        with torch.cuda.stream(stream):
            layers[i % n](tx, outputs=ty)

    return call


PEERS = {p.name: p for p in (Peer("humming", "humming-kernels", "humming", _humming),)}
