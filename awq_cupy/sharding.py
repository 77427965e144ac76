"""Tensor-parallel shards of packed AWQ layers, in the layer's own format, without dequantizing.

Megatron-style tensor parallelism splits a decoder's linears two ways:

* ``Split.COLUMN`` (q/k/v, gate/up): each rank holds a slice of the output features N and computes its slice of
  ``y``; nothing is exchanged after the matmul. A fused weight (q|k|v stored as one ``qkv_proj``) is split per
  part: rank r holds rank r's slice of every part, concatenated in part order.
* ``Split.ROW`` (o, down): each rank holds a slice of the input features K, multiplies the matching slice of
  ``x`` and produces a partial ``y``; the ranks' partials are summed (an all-reduce). The bias belongs to the sum,
  so only rank 0's shard keeps it.

The rules are AWQ's: an N shard is a multiple of 8 output channels (eight codes per int32 word, in every layout),
a K shard is a whole number of groups (a group's zero point and scale cannot be cut), and each shard must still
be a valid layer of its format (marlin: N % 64 and K % 16; gemv: K % 8; gemv_fast: K % 64; docs/formats.md
§Group sizes). A split that breaks one raises ``ValueError`` naming the layer, the size and the rule. Shards are
equal; ``align`` can ask for more (a multiple of the head size, so that no attention head is cut).

``gemm`` layers (the hub's) are sliced directly: rows of ``qweight`` for K, word columns for N. The other layouts
interleave K and N inside their words and tiles, so their shards go through the logical codes (``formats.unpack``,
exact) and are packed again in the same format (``formats.pack``): the codes, zero points and scales are the
same numbers, nothing is dequantized, and ``gemv_fast``'s scaled zeros are recomputed exactly as its producers
round them. Scales stored in another dtype than fp16 come back as fp16 (exactly, or ``unpack`` refuses them).
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from . import formats
from .checkpoint import QuantizedLayer
from .safetensors_io import dtype_code_of


class Split(str, enum.Enum):
    """How a linear is divided across ranks."""

    COLUMN = "column"   # output features: each rank computes a slice of y
    ROW = "row"         # input features: each rank computes a partial y, summed across ranks


@dataclass(frozen=True)
class ShardRule:
    """Modules whose last name component is one of ``modules`` are split ``split``-wise."""

    modules: tuple[str, ...]
    split: Split

    def __post_init__(self):
        if not self.modules or not all(isinstance(m, str) and m for m in self.modules):
            raise ValueError(f"ShardRule{self.modules}: needs one or more module names")
        if not isinstance(self.split, Split):
            raise TypeError(f"ShardRule split must be a Split, got {self.split!r}")


# Llama/Mistral/Qwen attention and MLP, Mixtral experts (w1/w3 column, w2 row), and their fused forms.
DEFAULT_SHARD_RULES: tuple[ShardRule, ...] = (
    ShardRule(("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "w13"),
              Split.COLUMN),
    ShardRule(("o_proj", "down_proj", "w2"), Split.ROW),
)


def split_for(name: str, rules: Sequence[ShardRule] = DEFAULT_SHARD_RULES) -> Split | None:
    """The split ``rules`` give the module ``name`` (by its last component), or None: replicate it."""
    leaf = name.rpartition(".")[2]
    hits = {r.split for r in rules if leaf in r.modules}
    if len(hits) > 1:
        raise ValueError(f"{name}: the shard rules give it both splits ({sorted(h.value for h in hits)})")
    return hits.pop() if hits else None


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``tp_size``'s piece of a layer: ``layer`` (in the source format; its ``in_features`` /
    ``out_features`` are the shard's), ``split`` (None: the whole layer, replicated), and the rows
    (``Split.ROW``: input features) or columns (``Split.COLUMN``: output features) of the full layer it holds,
    as ``[start, stop)`` ranges, one per part."""

    layer: QuantizedLayer
    split: Split | None
    tp_size: int
    rank: int
    ranges: tuple[tuple[int, int], ...]


def _check_tp(tp_size, rank) -> tuple[int, int]:
    for v, what in ((tp_size, "tp_size"), (rank, "rank")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    tp_size, rank = int(tp_size), int(rank)
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be at least 1")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank={rank} must be in 0..{tp_size - 1} for tp_size={tp_size}")
    return tp_size, rank


def shard_range(size: int, tp_size: int, rank: int, *, unit: int, what: str, rule: str) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s equal share of ``size``; the share must be a multiple of ``unit``
    (``what`` and ``rule`` word the error)."""
    tp_size, rank = _check_tp(tp_size, rank)
    if size % tp_size or (size // tp_size) % unit:
        raise ValueError(f"{what}={size} does not split {tp_size} ways: each share must be a multiple of {unit} "
                         f"({rule})")
    share = size // tp_size
    return rank * share, (rank + 1) * share


def shard_layer(layer: QuantizedLayer, split: Split, tp_size: int, rank: int, *,
                parts: Sequence[int] | None = None, align: int = 1) -> Shard:
    """Rank ``rank`` of ``tp_size``'s shard of ``layer`` (module docstring). ``parts``: for ``Split.COLUMN`` of a
    fused weight, the output features of each part in order (they sum to N; each is split on its own).
    ``align``: each share (of every part) must also be a multiple of this many features (e.g. the head size)."""
    if not isinstance(layer, QuantizedLayer):
        raise TypeError(f"shard_layer takes a QuantizedLayer (Checkpoint.layers[...]), got {type(layer).__name__}")
    if not isinstance(split, Split):
        raise TypeError(f"split must be a Split (Split.COLUMN or Split.ROW), got {split!r}")
    tp_size, rank = _check_tp(tp_size, rank)
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
        raise ValueError(f"align={align!r} must be a positive int")
    K, N, G, name = layer.in_features, layer.out_features, layer.group_size, layer.name
    if split is Split.ROW:
        if parts is not None:
            raise ValueError(f"{name}: parts split the output features; a row split cuts the input features")
        if G == K and tp_size > 1:
            raise ValueError(f"{name}: one group spans all of K={K}, so its input features cannot be cut into whole "
                             "groups (a row split needs G < K)")
        unit = int(np.lcm(G, align))
        ranges = (shard_range(K, tp_size, rank, unit=unit, what=f"{name}: K (in_features)",
                              rule=f"whole groups of G={G}" + (f" and multiples of align={align}" if align > 1
                                                                 else "")),)
    else:
        sizes = [N] if parts is None else [int(p) for p in parts]
        if parts is not None and (not sizes or any(p <= 0 for p in sizes) or sum(sizes) != N):
            raise ValueError(f"{name}: parts={list(parts)} must be positive and sum to N={N}")
        unit = int(np.lcm(8, align))
        ranges, start = [], 0
        for i, p in enumerate(sizes):
            what = f"{name}: N (out_features)" if parts is None else f"{name}: part {i} of the output ({p} of N={N})"
            a, b = shard_range(p, tp_size, rank, unit=unit, what=what,
                               rule="eight channels per packed word" + (f" and multiples of align={align}"
                                                                        if align > 1 else ""))
            ranges.append((start + a, start + b))
            start += p
        ranges = tuple(ranges)
    try:
        tensors, bias = _slice(layer, split, ranges, rank)
    except ValueError as e:           # a shard that is not a valid layer of its format
        raise ValueError(f"{name}: shard {rank} of {tp_size} ({split.value} split) is not a valid {layer.format} "
                         f"layer: {e}") from None
    k = sum(b - a for a, b in ranges) if split is Split.ROW else K
    n = sum(b - a for a, b in ranges) if split is Split.COLUMN else N
    codes = dict(layer.dtype_codes)
    if layer.format != "gemm":            # repacked: the arrays' own dtypes (fp16 scales)
        codes = {key: dtype_code_of(v.dtype) for key, v in tensors.items()}
    if bias is not None and "bias" in layer.dtype_codes:
        codes["bias"] = layer.dtype_codes["bias"]
    shard = dataclasses.replace(layer, in_features=k, out_features=n, tensors=tensors, bias=bias, dtype_codes=codes)
    return Shard(shard, split, tp_size, rank, ranges)



def _slice(layer: QuantizedLayer, split: Split, ranges, rank: int):
    K, G, fmt = layer.in_features, layer.group_size, layer.format
    bias = layer.bias
    if bias is not None:
        b = np.asarray(bias)
        bias = (np.concatenate([b[a:z] for a, z in ranges]) if split is Split.COLUMN
                else (np.array(b) if rank == 0 else None))   # a row split's bias is added once, to the sum
    if fmt == "gemm":
        t = layer.tensors
        if split is Split.ROW:
            (k0, k1), = ranges
            out = {"qweight": t["qweight"][k0:k1], "qzeros": t["qzeros"][k0 // G:k1 // G],
                   "scales": t["scales"][k0 // G:k1 // G]}
        else:
            out = {"qweight": np.concatenate([t["qweight"][:, a // 8:z // 8] for a, z in ranges], axis=1),
                   "qzeros": np.concatenate([t["qzeros"][:, a // 8:z // 8] for a, z in ranges], axis=1),
                   "scales": np.concatenate([t["scales"][:, a:z] for a, z in ranges], axis=1)}
        return {k: np.ascontiguousarray(v) for k, v in out.items()}, bias
    Q, Z, S = formats.unpack(layer.tensors, fmt, K, layer.config_group_size)
    if split is Split.ROW:
        (k0, k1), = ranges
        Q, Z, S = Q[k0:k1], Z[k0 // G:k1 // G], S[k0 // G:k1 // G]
    else:
        Q, Z, S = (np.concatenate([a_[:, a:z] for a, z in ranges], axis=1) for a_ in (Q, Z, S))
    packed = formats.pack(np.ascontiguousarray(Q), np.ascontiguousarray(Z), np.ascontiguousarray(S), fmt, G)
    if fmt == "gemv_fast" and "scaled_zeros" in layer.tensors:   # keep the producer's name for the zero tensor
        packed["scaled_zeros"] = packed.pop("qzeros")
    return packed, bias


def shard_layers(layers: Mapping[str, QuantizedLayer], tp_size: int, rank: int, *,
                 rules: Sequence[ShardRule] = DEFAULT_SHARD_RULES, parts: Mapping[str, Sequence[int]] | None = None,
                 align: Mapping[str, int] | None = None) -> dict[str, Shard]:
    """Rank ``rank``'s shard of every layer (``Checkpoint.layers``): split as ``rules`` say, whole (replicated)
    where no rule names the module. ``parts`` / ``align``: per module name, as for ``shard_layer``."""
    tp_size, rank = _check_tp(tp_size, rank)
    parts, align = dict(parts or {}), dict(align or {})
    out = {}
    for name, layer in layers.items():
        split = split_for(name, rules)
        if split is None:
            out[name] = Shard(layer, None, tp_size, rank, ((0, layer.out_features),))
        else:
            out[name] = shard_layer(layer, split, tp_size, rank, parts=parts.get(name), align=align.get(name, 1))
    return out
