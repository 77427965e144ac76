"""``QuantizedWeight``: a 4-bit layer repacked once, on the GPU, into awq_cupy's tensor-core layout.

Every checkpoint format goes through AutoAWQ ``gemm`` (``formats.to_gemm``; a no-op for gemm checkpoints), then
one repack kernel writes the fragment-ready tiles (``layout.py`` documents them) and the scales/zeros are
permuted and converted to the activation dtype. Peak extra memory during a gemm repack is the output itself
(the tiles are the size of ``qweight``); other formats first pass through their gemm form.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from . import layout, settings
from ._array import bfloat16_dtype, is_cupy, require_gpu
from .dtypes import dtype_name as _dtype_name
from .dtypes import numpy_dtype
from .jit import as_i32

__all__ = ["QuantizedWeight", "WeightLayout"]

# Every weight's cache of prepared calls (ops.matmul), emptied when the settings are reloaded.
_weights: "weakref.WeakSet[QuantizedWeight]" = weakref.WeakSet()
_weights_lock = threading.Lock()


def _drop_plans() -> None:
    with _weights_lock:
        for w in list(_weights):
            w._calls.clear()


settings.on_reload(_drop_plans)


class QuantizedWeight:
    """A W4A16 weight ``W [K, N]`` (``y = x @ W``) ready for ``awq_cupy.matmul``.

    Attributes: ``K`` (in_features), ``N`` (out_features), ``group_size`` (resolved: G = K for -1),
    ``dtype`` ('float16' or 'bfloat16': the activation dtype it serves), ``nbytes`` (device bytes held),
    ``device`` (CUDA device id), ``bias`` (the checkpoint's bias if it had one, else None; ``matmul`` adds a bias
    only when passed one explicitly), ``parts`` (for a fused weight from ``Checkpoint.to_gpu(fuse=...)``: each
    source layer's name and output columns; ``split(y)`` cuts an output into them; empty otherwise).

    Construct with ``from_checkpoint``, ``from_gemm`` or ``from_dense``; ``astype`` gives the other dtype's view
    (it shares the weight tiles and converts only scales/zeros).
    """

    def __init__(self, *, qtiles, scales, zeros, K: int, N: int, group_size: int, dtype: str, bias=None,
                 _scales_fp16=None):
        self.qtiles = qtiles          # uint32 [NT16, KS, 32, 4] (awq_cupy/layout.py)
        self.scales = scales          # uint16 bits of dtype [NG, Np], permuted
        self.zeros = zeros            # uint16 bits of dtype [NG, Np], permuted MAGIC + z
        self.K, self.N, self.group_size, self.dtype = int(K), int(N), int(group_size), dtype
        self.bias = bias
        self._scales_fp16 = _scales_fp16   # original fp16 scales [NG, N] (kept for astype), or None
        self.device = qtiles.device.id
        # a fused weight's source layers and their output columns (loading.Part), set by Checkpoint.to_gpu
        self.parts: tuple = ()
        # matmul's prepared calls, by call shape (ops.matmul): they hold this weight's device pointers, so the
        # arrays above are not to be replaced after construction
        self._calls: dict = {}
        self._xdtype = numpy_dtype(dtype)  # the activations' array dtype (bf16: ml_dtypes', or uint16 without it)
        with _weights_lock:
            _weights.add(self)

    # ---- derived sizes ------------------------------------------------------------------------------------
    @property
    def NT(self) -> int:
        """64-column chunks (Np / 64)."""
        return self.qtiles.shape[0] // 4

    @property
    def KT(self) -> int:
        """k16 steps (Kp / 16)."""
        return self.qtiles.shape[1] * 4

    @property
    def NT16(self) -> int:
        """16-column blocks of the tile layout (Np / 16)."""
        return self.qtiles.shape[0]

    @property
    def KS(self) -> int:
        """64-k blocks of the tile layout (Kp / 64)."""
        return self.qtiles.shape[1]

    @property
    def NG(self) -> int:
        return self.scales.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.K, self.N)

    @property
    def nbytes(self) -> int:
        n = self.qtiles.nbytes + self.scales.nbytes + self.zeros.nbytes
        return n + (self.bias.nbytes if self.bias is not None else 0)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(K={self.K}, N={self.N}, group_size={self.group_size}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, device={self.device})")

    def layout(self) -> "WeightLayout":
        """What a kernel of one's own needs to read this weight (kernels_cu/awq_cupy.cuh, docs/kernel-api.md)."""
        Kp, Np = layout.padded_sizes(self.K, self.N)
        return WeightLayout(qtiles=self.qtiles, scales=self.scales, zeros=self.zeros, K=self.K, N=self.N, Kp=Kp,
                            Np=Np, NT16=self.NT16, KS=self.KS, group_size=self.group_size, NG=self.NG,
                            dtype=self.dtype, device=self.device)

    def split(self, y) -> dict:
        """A fused weight's output ``y [..., N]`` as ``{part name: y[..., start:stop]}`` (views, no copy)."""
        if not self.parts:
            raise ValueError("split() is for fused weights (Checkpoint.to_gpu(fuse=...)); this one has no parts")
        if getattr(y, "ndim", 0) < 1 or y.shape[-1] != self.N:
            raise ValueError(f"y has shape {getattr(y, 'shape', None)}; its last dimension must be N={self.N}")
        return {p.name: y[..., p.start:p.stop] for p in self.parts}

    # ---- constructors -------------------------------------------------------------------------------------
    @classmethod
    def from_gemm(cls, qweight, qzeros, scales, group_size, *, dtype="float16", bias=None, device=None):
        """From AutoAWQ gemm tensors (numpy or cupy; numpy is uploaded to ``device`` or the current device)."""
        import cupy

        from .formats import resolve_group_size
        from .kernels import REPACK_KERNEL, kernel

        kind = _dtype_name(dtype)
        if getattr(qweight, "ndim", 0) == 2 and qweight.shape[0] % 8:   # before touching a device: a CPU error
            raise ValueError(f"in_features K={qweight.shape[0]} (qweight rows) is not a multiple of 8: the kernels "
                             "read each activation row 16 bytes at a time")
        require_gpu("QuantizedWeight.from_gemm")
        with cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice()):
            qweight, qzeros, scales = (cupy.asarray(a) for a in (qweight, qzeros, scales))
            if bias is not None:
                bias = cupy.asarray(bias)
            for name, a in (("qweight", qweight), ("qzeros", qzeros)):
                if a.dtype not in (np.int32, np.uint32) or a.ndim != 2:
                    raise TypeError(f"{name} must be a 2-D int32 array of packed words, got {a.dtype} {a.shape}")
            K, N = qweight.shape[0], 8 * qweight.shape[1]
            G = resolve_group_size(group_size, K)
            check_group_size(K, G)
            NG = K // G
            if scales.shape != (NG, N):
                raise ValueError(f"scales shape {scales.shape} disagrees with qweight {qweight.shape} and "
                                 f"group_size={group_size}: expected {(NG, N)}")
            if qzeros.shape != (NG, N // 8):
                raise ValueError(f"qzeros shape {qzeros.shape} disagrees with qweight {qweight.shape} and "
                                 f"group_size={group_size}: expected {(NG, N // 8)}")
            if bias is not None and bias.shape != (N,):
                raise ValueError(f"bias shape {bias.shape} must be ({N},)")
            Kp, Np = layout.padded_sizes(K, N)
            NT16, KS = Np // 16, Kp // layout.K_ALIGN
            qtiles = cupy.empty((NT16, KS, 32, 4), dtype=cupy.uint32)
            qweight = cupy.ascontiguousarray(qweight).view(cupy.uint32)
            total = qtiles.size
            k = kernel(REPACK_KERNEL)
            k.launch((min((total + 255) // 256, 1 << 20),), (256,),
                     (qweight, qtiles, as_i32(K), as_i32(N), as_i32(NT16), as_i32(KS)))
            # Zeros: unpack the gemm words (column 8c + j in nibble slot REV[j]) -> [NG, N] codes.
            shifts = cupy.asarray((4 * layout.REV).astype(np.uint32))
            Z = ((qzeros.view(cupy.uint32)[:, :, None] >> shifts) & cupy.uint32(0xF)).reshape(NG, N)
            S16 = _as_fp16_scales(scales)
            w = cls._finish(qtiles, S16, Z, K, N, G, kind, bias)
        return w

    @classmethod
    def _finish(cls, qtiles, S16, Z, K, N, G, kind, bias):
        Np = qtiles.shape[0] * 16
        scales = layout.permute_columns(layout.float_bits(S16.astype(np.float32), kind), Np)
        zeros = layout.permute_columns(layout.zero_bits(Z, kind), Np)
        if bias is not None:
            bias = _cast_vector(bias, kind)
        return cls(qtiles=qtiles, scales=scales, zeros=zeros, K=K, N=N, group_size=G, dtype=kind, bias=bias,
                   _scales_fp16=(S16, Z))

    @classmethod
    def from_checkpoint(cls, tensors, fmt=None, group_size=None, *, dtype="float16", device=None):
        """From one layer's packed tensors (a dict of numpy/cupy arrays in any of the four AWQ formats) or from
        a ``checkpoint.QuantizedLayer`` (then ``fmt`` and ``group_size`` come from it). ``fmt=None`` detects
        the format from the tensors; ``group_size`` is required for dicts (-1 means one group of K)."""
        require_gpu("QuantizedWeight.from_checkpoint")
        import cupy

        from . import formats

        if hasattr(tensors, "tensors") and hasattr(tensors, "format"):    # checkpoint.QuantizedLayer
            layer = tensors
            tensors, fmt = dict(layer.tensors), fmt or layer.format
            group_size = group_size if group_size is not None else layer.group_size
            if getattr(layer, "bias", None) is not None:
                tensors.setdefault("bias", layer.bias)
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors must be a dict of arrays or a QuantizedLayer, got {type(tensors).__name__}")
        if group_size is None:
            raise TypeError("group_size is required (-1 means a single group of K)")
        found = formats.infer_shape(tensors)
        fmt = found.fmt if fmt is None else str(fmt).lower()
        if fmt not in formats.FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {formats.FORMATS}")
        if fmt != found.fmt:
            raise ValueError(f"tensors look like {found.fmt!r}, not fmt={fmt!r}")
        K = found.in_features
        with cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice()):
            gpu = {k: _to_gpu(v) for k, v in tensors.items()}
            g = gpu if fmt == "gemm" else formats.to_gemm(gpu, fmt, K, group_size)
            return cls.from_gemm(g["qweight"], g["qzeros"], g["scales"], group_size, dtype=dtype,
                                 bias=g.get("bias"))

    @classmethod
    def from_dense(cls, weight, group_size=128, *, dtype="float16", zero_point=True, device=None):
        """Quantize a dense weight (round-to-nearest, AutoAWQ semantics) and repack it.

        ``weight`` is in nn.Linear / checkpoint layout ``[N, K]`` (out_features, in_features), like
        ``awq_cupy.quantize``; numpy or cupy, fp16 or fp32."""
        from .formats import pack
        from .quantize import quantize

        require_gpu("QuantizedWeight.from_dense")
        q = quantize(weight, group_size=group_size, zero_point=zero_point)
        packed = pack(q.Q, q.Z, q.S, "gemm", q.group_size)
        return cls.from_gemm(packed["qweight"], packed["qzeros"], packed["scales"], q.group_size, dtype=dtype,
                             device=device)

    def astype(self, dtype) -> "QuantizedWeight":
        """The same weight serving activations of ``dtype`` (shares the tiles; converts scales and zeros)."""
        kind = _dtype_name(dtype)
        if kind == self.dtype:
            return self
        import cupy

        S16, Z = self._scales_fp16
        with cupy.cuda.Device(self.device):
            w = QuantizedWeight._finish(self.qtiles, S16, Z, self.K, self.N, self.group_size, kind, None)
            if self.bias is not None:
                w.bias = _cast_vector(self.bias, kind)
        w.parts = self.parts
        return w


@dataclass(frozen=True, eq=False)
class WeightLayout:
    """A ``QuantizedWeight`` as device code sees it (kernels_cu/awq_cupy.cuh has the byte-level contract).

    ``qtiles`` uint32 CuPy array ``[NT16, KS, 32, 4]`` (a uint4 per lane and block; column block ``t`` starts at
    uint4 ``t * KS * 32``), ``scales`` and ``zeros`` ``[NG, Np]`` 16-bit patterns of ``dtype`` (column-permuted
    per 16-column block; zeros hold MAGIC + z). ``Kp``/``Np``: K and N rounded up to 64. ``args()`` gives them in
    the header's order as kernel arguments: the three arrays, then K, N, KS, Np, group_size, NG as int32.
    """

    qtiles: object
    scales: object
    zeros: object
    K: int
    N: int
    Kp: int
    Np: int
    NT16: int
    KS: int
    group_size: int
    NG: int
    dtype: str
    device: int

    @property
    def block_stride(self) -> int:
        """uint4 elements from one 16-column block of ``qtiles`` to the next (``KS * 32``)."""
        return self.KS * 32

    def args(self) -> tuple:
        return (self.qtiles, self.scales, self.zeros, as_i32(self.K), as_i32(self.N), as_i32(self.KS),
                as_i32(self.Np), as_i32(self.group_size), as_i32(self.NG))


def check_group_size(K: int, G: int) -> None:
    """The tensor-core kernels need every 64-k stage to touch at most two groups: G % 32 == 0, or G == K."""
    if not (G == K or G % 32 == 0):
        raise ValueError(f"group_size={G} is not supported by the awq_cupy kernels for K={K}: use a multiple "
                         "of 32 (32, 64, 128, ...) or -1 (one group)")


def _is_bf16_numpy(a) -> bool:
    bf = bfloat16_dtype()
    return bf is not None and not is_cupy(a) and a.dtype == bf


def _to_gpu(a):
    import cupy

    if _is_bf16_numpy(a):   # keep the bits; formats reads bf16 as uint16 patterns too
        return cupy.asarray(np.ascontiguousarray(a).view(np.uint16))
    return cupy.asarray(a)


def _as_fp16_scales(scales):
    import cupy

    if scales.dtype == np.float16:
        return scales
    if scales.dtype == np.float32:
        return scales.astype(cupy.float16)
    bf = bfloat16_dtype()
    if scales.dtype == np.uint16 or (bf is not None and scales.dtype == bf):
        # bf16 scales (llm-awq): widen exactly to fp32 by the bit pattern; kept as float32 for the conversion
        return (scales.view(cupy.uint16).astype(cupy.uint32) << cupy.uint32(16)).view(cupy.float32)
    raise TypeError(f"scales must be float16 (or bf16/float32), got {scales.dtype}")


def _cast_vector(v, kind):
    """A bias vector as uint16 bits of ``kind`` (accepts fp16, fp32, bf16 arrays)."""
    import cupy

    v = cupy.asarray(v)
    bf = bfloat16_dtype()
    if v.dtype == np.uint16 or (bf is not None and v.dtype == bf):
        v32 = (v.view(cupy.uint16).astype(cupy.uint32) << cupy.uint32(16)).view(cupy.float32)
    else:
        v32 = v.astype(cupy.float32)
    return typed(cupy.ascontiguousarray(layout.float_bits(v32, kind)), kind)


def typed(bits, kind):
    """uint16 bit patterns -> an array of dtype ``kind`` (bf16: ml_dtypes.bfloat16 if installed, else uint16)."""
    return bits.view(numpy_dtype(kind))
