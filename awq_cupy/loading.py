"""A checkpoint's quantized layers on the GPU in one call, optionally fused: ``Checkpoint.to_gpu``.

Fusion (docs/design.md §Loading a model): layers that read the same input (q/k/v, gate/up) become one weight
whose output columns are the parts side by side, so a model step runs one matmul instead of three (fewer launches,
a larger N that fills the GPU better at decode sizes). It is exact: the packed gemm tensors are concatenated along
N (qweight/qzeros eight columns per int32 word, scales one per column), so every output column is computed from
the same codes, zeros and scales as in its own layer. Which modules fuse is data (``FuseRule``); a group fuses
only when all its parts are loaded and share K and the group size, otherwise its layers load separately.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from . import formats
from ._array import get_xp, is_bfloat16, make_reporter, require_gpu
from .weight import QuantizedWeight, _as_fp16_scales, _to_gpu

__all__ = ["FuseRule", "Part", "LoadGroup", "DEFAULT_FUSE_RULES", "plan_groups", "to_gpu"]


@dataclass(frozen=True)
class FuseRule:
    """Sibling modules fused into one weight: ``<parent>.<part>`` for each of ``parts`` (in this column order)
    become ``<parent>.<fused>``."""

    parts: tuple[str, ...]
    fused: str

    def __post_init__(self):
        if len(self.parts) < 2 or len(set(self.parts)) != len(self.parts) or self.fused in self.parts:
            raise ValueError(f"FuseRule{self.parts} -> {self.fused!r}: needs two or more distinct parts and a new name")


# The sibling sets of the common decoder families: Llama/Mistral/Qwen attention and MLP, Mixtral experts.
DEFAULT_FUSE_RULES: tuple[FuseRule, ...] = (
    FuseRule(("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    FuseRule(("gate_proj", "up_proj"), "gate_up_proj"),
    FuseRule(("w1", "w3"), "w13"),
)


@dataclass(frozen=True)
class Part:
    """One source layer inside a fused weight: its module name and its output columns ``[start, stop)``."""

    name: str
    start: int
    stop: int

    @property
    def width(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LoadGroup:
    """One weight ``to_gpu`` returns: its name and the checkpoint layers it is made of (one unless fused)."""

    name: str
    members: tuple[str, ...]

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


def _rules(fuse) -> tuple[FuseRule, ...]:
    if fuse is False or fuse is None:
        return ()
    if fuse is True:
        return DEFAULT_FUSE_RULES
    if isinstance(fuse, FuseRule):
        return (fuse,)
    if isinstance(fuse, Iterable) and not isinstance(fuse, (str, bytes, Mapping)):
        rules = tuple(fuse)
        if all(isinstance(r, FuseRule) for r in rules):
            return rules
    raise TypeError(f"fuse={fuse!r}: expected True (DEFAULT_FUSE_RULES), False, or FuseRule objects")


def plan_groups(layers: Mapping, fuse=False) -> tuple[LoadGroup, ...]:
    """What ``to_gpu`` will build from ``layers`` (name -> QuantizedLayer, in order): fused groups where a rule's
    parts all exist with one K and one group size, single layers otherwise. A fused weight takes the place of
    its first part. No data is read."""
    rules = _rules(fuse)
    taken: dict[str, LoadGroup] = {}
    for rule in rules:
        first = rule.parts[0]
        for name in layers:
            parent, _, leaf = name.rpartition(".")
            if leaf != first or name in taken:
                continue
            prefix = parent + "." if parent else ""
            members = tuple(prefix + p for p in rule.parts)
            if any(m not in layers or m in taken for m in members):
                continue
            shapes = {(layers[m].in_features, layers[m].group_size) for m in members}
            if len(shapes) != 1:
                continue                    # different K or G: they cannot share one input and one kernel
            fused = prefix + rule.fused
            if fused in layers:
                raise ValueError(f"cannot fuse {list(members)} into {fused!r}: the checkpoint already has a "
                                 f"layer of that name")
            group = LoadGroup(fused, members)
            for m in members:
                taken[m] = group
    out, seen = [], set()
    for name in layers:
        g = taken.get(name, LoadGroup(name, (name,)))
        if g.name not in seen:
            seen.add(g.name)
            out.append(g)
    return tuple(out)


def to_gpu(ckpt, *, dtype="float16", device=None, fuse=False, names: Sequence[str] | None = None, progress=None,
           validate: bool = True) -> dict[str, QuantizedWeight]:
    """``{name: QuantizedWeight}`` for a checkpoint's quantized layers, uploaded and repacked layer by layer.

    ``dtype``: the activations' dtype ('float16' or 'bfloat16'). ``device``: CUDA device id (default: current).
    ``names``: only these modules (default: every quantized layer). ``fuse``: False; True for
    ``DEFAULT_FUSE_RULES`` (``q/k/v_proj -> qkv_proj``, ``gate/up_proj -> gate_up_proj``, ``w1/w3 -> w13``); or
    ``FuseRule`` objects. A fused weight is returned under the fused name with ``weight.parts`` (``Part(name,
    start, stop)`` per source layer, column ranges of its output) and ``weight.split(y)`` giving each part's
    columns as views; its ``bias`` joins the parts' biases (zeros for a part without one). ``validate``: reject
    NaN/Inf scales or biases with a ``CheckpointError`` naming the layer (one device reduction per layer).
    ``progress``: None (a line on stderr for checkpoints of 2 GiB or more), True, False or a callable
    ``(done, total, description)``.

    Memory: host memory holds one layer at a time (the checkpoint's arrays are file mappings read as they are
    uploaded); the GPU holds the results plus one group's gemm tensors while it is converted.
    """
    require_gpu("Checkpoint.to_gpu")
    import cupy

    from .checkpoint import AUTO_PROGRESS_BYTES, CheckpointError
    from .dtypes import dtype_name

    kind = dtype_name(dtype)
    layers = ckpt.layers
    if names is not None:
        if isinstance(names, str):
            raise TypeError("names must be a list of module names, not one string")
        names = list(names)
        unknown = [n for n in names if n not in layers]
        if unknown:
            raise ValueError(f"names: {unknown[:5]} are not quantized layers of {ckpt.path}")
        wanted = set(names)
        layers = {n: layer for n, layer in layers.items() if n in wanted}
    groups = plan_groups(layers, fuse)
    report = make_reporter(progress, ckpt.nbytes >= AUTO_PROGRESS_BYTES)
    dev = device if device is not None else cupy.cuda.runtime.getDevice()
    out: dict[str, QuantizedWeight] = {}
    with cupy.cuda.Device(dev):
        for i, g in enumerate(groups):
            parts = [_gemm_tensors(layers[m]) for m in g.members]
            if validate:
                for m, p in zip(g.members, parts):
                    _check_finite(p, m, CheckpointError)
            G = layers[g.members[0]].group_size
            if g.fused:
                qweight, qzeros, scales, bias, spans = _concat(parts, [layers[m] for m in g.members])
            else:
                p = parts[0]
                qweight, qzeros, scales, bias, spans = p["qweight"], p["qzeros"], p["scales"], p.get("bias"), ()
            w = QuantizedWeight.from_gemm(qweight, qzeros, scales, G, dtype=kind, bias=bias)
            if g.fused:
                w.parts = tuple(Part(m, a, b) for m, (a, b) in zip(g.members, spans))
            out[g.name] = w
            del parts, qweight, qzeros, scales, bias    # the gemm copies go before the next group is read
            if report:
                report(i + 1, len(groups), f"loading {g.name}")
    return out


def _gemm_tensors(layer) -> dict:
    """One layer's gemm tensors on the current device (bias too, if it has one)."""
    gpu = {k: _to_gpu(v) for k, v in layer.tensors.items()}
    g = gpu if layer.format == "gemm" else formats.to_gemm(gpu, layer.format, layer.in_features,
                                                           layer.config_group_size)
    g = {k: g[k] for k in ("qweight", "qzeros", "scales")}
    if layer.bias is not None:
        g["bias"] = _to_gpu(layer.bias)
    return g


def _as_float32(v):
    """fp16/fp32/bf16 (also as uint16 bit patterns) -> float32, exactly (numpy or cupy)."""
    if v.dtype == np.uint16 or is_bfloat16(v.dtype):
        return formats.bf16_bits_to_float32(v.view(np.uint16))
    return v.astype(np.float32)


def _check_finite(p: dict, name: str, error) -> None:
    import cupy

    for key in ("scales", "bias"):
        if key not in p:
            continue
        a = _as_float32(p[key]) if key == "bias" else _as_fp16_scales(p[key])
        finite = cupy.isfinite(a)
        bad = a.size - int(cupy.count_nonzero(finite))
        if bad:
            first = np.unravel_index(int(cupy.argmin(finite.ravel())), a.shape)
            raise error(f"layer {name!r}: {bad} of its {a.size} {key} are NaN or Inf (first at index "
                        f"{tuple(int(i) for i in first)}); the checkpoint is damaged. "
                        f"Pass validate=False to load it anyway.")


def _concat(parts: list[dict], layers: list) -> tuple:
    """The parts' gemm tensors side by side along N, and each part's column span (numpy or cupy arrays)."""
    xp = get_xp(*(a for p in parts for a in p.values()))

    scales = [_as_fp16_scales(p["scales"]) for p in parts]
    if len({s.dtype for s in scales}) > 1:
        scales = [s.astype(np.float32) for s in scales]     # exact for fp16 and widened bf16 alike
    spans, start = [], 0
    for layer in layers:
        spans.append((start, start + layer.out_features))
        start += layer.out_features
    bias = None
    if any("bias" in p for p in parts):
        bias = xp.concatenate([_as_float32(p["bias"]) if "bias" in p else xp.zeros(layer.out_features, np.float32)
                               for p, layer in zip(parts, layers)])
    qweight = xp.concatenate([p["qweight"].view(np.int32) for p in parts], axis=1)
    qzeros = xp.concatenate([p["qzeros"].view(np.int32) for p in parts], axis=1)
    return qweight, qzeros, xp.concatenate(scales, axis=1), bias, tuple(spans)
