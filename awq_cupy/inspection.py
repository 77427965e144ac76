"""What is in an AWQ checkpoint, and is it sound: the backend of ``awq-cupy inspect PATH [--json]``.

Why a separate pass: ``load_checkpoint`` opens lazily and checks only what the headers say (names, dtypes,
shapes, the config). A checkpoint can pass all of that and still be broken in its values: a NaN or zero scale
from a failed calibration, a ``gemv_fast`` scaled zero that no integer zero point explains, a symmetric
(``zero_point: false``) config over asymmetric zeros, a NaN bias. Such files load fine and produce garbage (or
fail only when a layer is converted for the GPU), so this module reads the values that decide it, layer by layer,
and reports every finding as a typed ``Problem`` instead of raising at the first one.

What is read: only each layer's scales, zero tensor and bias. ``qweight`` is never touched: its codes are 4-bit
nibbles, every bit pattern of which is a valid code, and it is the big tensor (about 30 times the scales). Host
memory is bounded by one layer's scales and zeros as float32. Values are reported in logical coordinates
(group ``g = k // G``, output column ``n``; docs/formats.md §Conventions) whatever the layout stores, so the same
weight gives the same report in every format.

The checks (docs/formats.md §Dequantization: ``W = (Q - Z) * S``):

* scales NaN/Inf, and scales <= 0 (a zero scale makes its whole group 0; AutoAWQ's quantizer never writes one,
  and never a negative one) -> ERROR;
* ``gemv_fast``: the zero tensor holds ``SZ = -(S * Z)`` rounded once to its dtype
  (docs/formats.md §The gemv_fast layout), so ``Z = rint(-SZ / S)`` must lie in 0..15 and reproduce ``SZ``
  exactly; awq_cupy's conversion (``formats.unpack``, strict) refuses anything else -> ERROR;
* ``zero_point: false`` in the config with a zero point other than 8 -> ERROR. (``gemm``/``gemv`` zero nibbles are
  always 0..15, so that is the only way they can be wrong; docs/formats.md §Config and version tags);
* bias NaN/Inf -> ERROR;
* what ``load_checkpoint`` warns about (tensors of a module without its ``qweight``, a quantized config without a
  quantized layer, a ``version`` tag that contradicts the detected layout) -> WARNING. The warnings are captured,
  not printed, and rebuilt from the ``Checkpoint`` itself so each problem names its module; a
  ``CheckpointWarning`` this module does not know becomes a ``CHECKPOINT_WARNING`` problem with its text;
* a group size the format allows (a multiple of 8) but the GPU kernels do not (a multiple of 32, or one group
  per layer: ``weight.check_group_size``) -> WARNING, one per group size: ``to_gpu`` and ``QuantizedWeight``
  refuse those layers, ``awq_cupy.dequantize`` still runs them on the CPU.

A ``CheckpointError`` from ``load_checkpoint`` (missing path, corrupt file, unsupported config) propagates from
``inspect_checkpoint``; ``main`` turns it into exit code 2.
"""
from __future__ import annotations

import enum
import json
import re
import sys
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import numpy as np

from . import formats
from ._array import make_reporter
from .weight import check_group_size
from .checkpoint import (AUTO_PROGRESS_BYTES, Checkpoint, CheckpointError, CheckpointWarning, FormatMismatchWarning,
                         NoQuantizedLayersWarning, OrphanTensorsWarning, QuantConfig,
                         QuantizedLayer, load_checkpoint)

__all__ = ["Severity", "Rule", "Problem", "LayerInfo", "TensorSummary", "Report", "inspect_checkpoint", "main",
           "SCHEMA_VERSION"]

SCHEMA_VERSION = 1                     # of Report.to_dict(); bumped when a key changes meaning or goes away
_LIST_ALL_TENSORS = 12                 # format_text lists the other tensors one by one up to this many
_FIRST_TENSORS = 5                     # ... and beyond it shows counts by dtype plus this many names
_MAX_CODE = 15
_SYMMETRIC_ZERO = 8


class Severity(str, enum.Enum):
    """ERROR: the values are wrong (the weight computes garbage or awq_cupy refuses it). WARNING: the file loads
    and computes what it says, but something in it is probably not what its writer meant."""

    ERROR = "error"
    WARNING = "warning"


class Rule(str, enum.Enum):
    """Stable identifiers of the checks (the JSON output carries the member name)."""

    NONFINITE_SCALE = "NONFINITE_SCALE"
    NONPOSITIVE_SCALE = "NONPOSITIVE_SCALE"
    ZERO_OUT_OF_RANGE = "ZERO_OUT_OF_RANGE"          # gemv_fast: rint(-SZ/S) outside 0..15, or SZ not finite
    ZERO_NOT_INTEGER = "ZERO_NOT_INTEGER"            # gemv_fast: SZ is not -(S*Z) rounded once, for any code Z
    ASYMMETRIC_ZERO = "ASYMMETRIC_ZERO"              # zero_point=false but a zero point is not 8
    NONFINITE_BIAS = "NONFINITE_BIAS"
    UNREADABLE = "UNREADABLE"                        # a layer's scales/zeros/bias could not be read
    ORPHAN_TENSOR = "ORPHAN_TENSOR"                  # qzeros/scaled_zeros/scales of a module with no qweight
    NO_QUANTIZED_LAYERS = "NO_QUANTIZED_LAYERS"
    FORMAT_MISMATCH = "FORMAT_MISMATCH"              # the version tag contradicts the detected layout
    CHECKPOINT_WARNING = "CHECKPOINT_WARNING"        # any other CheckpointWarning load_checkpoint emitted
    GROUP_SIZE_NOT_ON_GPU = "GROUP_SIZE_NOT_ON_GPU"  # valid in the format, refused by the GPU kernels


_SEVERITY = {Rule.ORPHAN_TENSOR: Severity.WARNING, Rule.NO_QUANTIZED_LAYERS: Severity.WARNING,
             Rule.FORMAT_MISMATCH: Severity.WARNING, Rule.CHECKPOINT_WARNING: Severity.WARNING,
             Rule.GROUP_SIZE_NOT_ON_GPU: Severity.WARNING}


@dataclass(frozen=True)
class Problem:
    """One finding. ``where``: the layer (module) or tensor name, or the checkpoint / config path for
    checkpoint-wide findings. ``count``: how many values (or tensors, or modules) are affected. ``index``: the
    first offending value in logical coordinates, ``(group, column)`` for scales and zeros, ``(column,)`` for a
    bias, None when the problem is not about values."""

    severity: Severity
    where: str
    rule: Rule
    message: str
    count: int = 1
    index: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        return {"severity": self.severity.value, "where": self.where, "rule": self.rule.value,
                "message": self.message, "count": self.count,
                "index": list(self.index) if self.index is not None else None}


@dataclass(frozen=True)
class LayerInfo:
    """One quantized layer, from the headers alone. ``group_size`` is resolved (-1 -> K), ``config_group_size``
    is the config's value; ``nbytes`` counts all its tensors, bias included; ``dtypes`` maps each tensor's short
    name (``qweight``, ``qzeros``/``scaled_zeros``, ``scales``, ``bias``) to its declared safetensors dtype;
    ``source`` is the file holding its ``qweight``, relative to the checkpoint directory."""

    name: str
    format: str
    in_features: int
    out_features: int
    group_size: int
    config_group_size: int
    nbytes: int
    has_bias: bool
    dtypes: Mapping[str, str] = field(default_factory=dict, hash=False)
    source: str = ""

    @property
    def K(self) -> int:
        return self.in_features

    @property
    def N(self) -> int:
        return self.out_features

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "in_features": self.in_features,
                "out_features": self.out_features, "group_size": self.group_size,
                "config_group_size": self.config_group_size, "nbytes": self.nbytes, "has_bias": self.has_bias,
                "dtypes": dict(self.dtypes), "source": self.source}


@dataclass(frozen=True)
class TensorSummary:
    """A tensor that is not part of a quantized layer (embeddings, norms, ``lm_head``, ...), from its header."""

    name: str
    dtype: str                         # declared safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int
    source: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "source": self.source}


@dataclass(frozen=True)
class Report:
    """The result of ``inspect_checkpoint``. ``scanned`` is False when the values were not read (``scan=False``):
    then only header- and config-level problems can appear."""

    path: Path
    quant_config: QuantConfig
    layers: tuple[LayerInfo, ...]
    tensors: tuple[TensorSummary, ...]
    problems: tuple[Problem, ...]
    files: tuple[Path, ...]
    scanned: bool = True

    @property
    def ok(self) -> bool:
        """No ERROR problem (warnings allowed)."""
        return not self.errors

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity is Severity.ERROR)

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity is Severity.WARNING)

    @property
    def layers_per_format(self) -> dict[str, int]:
        """``{format: number of layers}`` in ``formats.FORMATS`` order, formats without layers left out."""
        counts = Counter(layer.format for layer in self.layers)
        return {f: counts[f] for f in formats.FORMATS if counts[f]}

    @property
    def quantized_nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def other_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict:
        """JSON-serialisable, with stable keys (``schema`` is ``SCHEMA_VERSION``), for scripts."""
        qc = self.quant_config
        return {
            "schema": SCHEMA_VERSION,
            "path": str(self.path),
            "ok": self.ok,
            "scanned": self.scanned,
            "files": [str(f) for f in self.files],
            "quant_config": {"quant_method": qc.quant_method, "bits": qc.bits, "group_size": qc.group_size,
                             "zero_point": qc.zero_point, "version": qc.version,
                             "modules_to_not_convert": list(qc.modules_to_not_convert), "source": qc.source},
            "summary": {"layers": len(self.layers), "layers_per_format": self.layers_per_format,
                        "quantized_nbytes": self.quantized_nbytes, "other_tensors": len(self.tensors),
                        "other_nbytes": self.other_nbytes, "errors": len(self.errors),
                        "warnings": len(self.warnings)},
            "layers": [layer.to_dict() for layer in self.layers],
            "tensors": [t.to_dict() for t in self.tensors],
            "problems": [p.to_dict() for p in self.problems],
        }

    def format_text(self) -> str:
        """A table for people: the config, one line per layer, the other tensors, the problems, and a last line
        ``N problems (...)`` or ``no problems found``."""
        qc = self.quant_config
        out = []
        shown = ", ".join(f.name for f in self.files[:3]) + (f", ... ({len(self.files)} files)"
                                                             if len(self.files) > 3 else "")
        out.append(f"checkpoint: {self.path} ({shown})")
        skip = f", modules_to_not_convert {list(qc.modules_to_not_convert)}" if qc.modules_to_not_convert else ""
        out.append(f"config: {qc.quant_method} {qc.bits}-bit, version {qc.version}, group_size {qc.group_size}, "
                   f"zero_point {str(qc.zero_point).lower()}{skip} (from {qc.source})")
        per_fmt = ", ".join(f"{f} {n}" for f, n in self.layers_per_format.items())
        out.append(f"{len(self.layers)} quantized layer{_s(len(self.layers))}" + (f" ({per_fmt})" if per_fmt else "")
                   + f", {_size(self.quantized_nbytes)}; {len(self.tensors)} other tensor{_s(len(self.tensors))}, "
                   f"{_size(self.other_nbytes)}")
        if self.layers:
            out.append("")
            out.extend(_table(["layer", "format", "K", "N", "G", "bytes", "bias"],
                              [[layer.name, layer.format, layer.in_features, layer.out_features, layer.group_size,
                                layer.nbytes, "yes" if layer.has_bias else "no"] for layer in self.layers],
                              right={2, 3, 4, 5}))
        if self.tensors:
            out.append("")
            out.append(f"other tensors ({len(self.tensors)}):")
            listed = self.tensors
            if len(self.tensors) > _LIST_ALL_TENSORS:
                by_dtype: dict[str, list[int]] = {}
                for t in self.tensors:
                    c = by_dtype.setdefault(t.dtype, [0, 0])
                    c[0] += 1
                    c[1] += t.nbytes
                out.append("  by dtype: " + ", ".join(f"{d} {n} ({_size(b)})" for d, (n, b) in by_dtype.items()))
                listed = self.tensors[:_FIRST_TENSORS]
            out.extend("  " + row for row in _table(
                None, [[t.name, t.dtype, "[" + ", ".join(map(str, t.shape)) + "]", t.nbytes] for t in listed],
                right={3}))
            if len(listed) < len(self.tensors):
                out.append(f"  ... and {len(self.tensors) - len(listed)} more (the JSON output lists them all)")
        out.append("")
        if not self.scanned:
            out.append("values not scanned (scales, zeros and biases were not read)")
        for p in self.problems:
            out.append(f"{p.severity.value:<7} {p.rule.value} {p.where}: {p.message}")
        if self.problems:
            e, w = len(self.errors), len(self.warnings)
            out.append(f"{len(self.problems)} problem{_s(len(self.problems))} "
                       f"({e} error{_s(e)}, {w} warning{_s(w)})")
        else:
            out.append("no problems found")
        return "\n".join(out) + "\n"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _size(n: int) -> str:
    """Exact bytes, and a binary-prefixed size when that reads better."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _table(header: list[str] | None, rows: list[list[Any]], right: set[int]) -> list[str]:
    cells = [[str(c) for c in row] for row in ([header] if header else []) + rows]
    if not cells:
        return []
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in cells]


def _natural_key(name: str):
    # layers.10 after layers.9: compare digit runs as numbers
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------------------------
# Inspecting

def inspect_checkpoint(path, *, scan: bool = True, progress=None, bf16: str = "auto") -> Report:
    """Open the checkpoint at ``path`` (see ``load_checkpoint``) and report on it; see the module docstring.

    ``scan=False`` reads headers only (no values: no scale, zero or bias problems can be found). ``progress``:
    None (stderr, on a terminal, for at least 2 GiB of layers), True, False or a callable ``(done, total,
    description)``, called once per layer scanned. ``bf16`` goes to ``load_checkpoint`` (both ml_dtypes arrays and
    uint16 bit patterns are read correctly). Raises ``CheckpointError`` when the checkpoint cannot be opened.
    """
    make_reporter(progress, False)                     # a bad ``progress`` fails before any work
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = load_checkpoint(path, progress=False, bf16=bf16)
    # Warnings that are not the loader's own were swallowed by the recording: hand them back to the caller's
    # filters. The loader's are turned into problems below instead of being printed.
    ours = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    for w in caught:
        if not issubclass(w.category, CheckpointWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    with ckpt:
        names = sorted(ckpt.layers, key=_natural_key)
        layers = tuple(_layer_info(ckpt, ckpt.layers[n]) for n in names)
        tensors = tuple(_tensor_summary(ckpt, n) for n in sorted(ckpt.tensors, key=_natural_key))
        problems = _checkpoint_problems(ckpt, ours)
        if scan:
            report = make_reporter(progress, sum(layer.nbytes for layer in layers) >= AUTO_PROGRESS_BYTES)
            for i, name in enumerate(names):
                problems.extend(_scan_layer(ckpt.layers[name], ckpt.quant_config))
                if report:
                    report(i + 1, len(names), f"scanning {name}")
        return Report(path=Path(path), quant_config=ckpt.quant_config, layers=layers, tensors=tensors,
                      problems=tuple(problems), files=tuple(ckpt.files), scanned=bool(scan))


def _relative(ckpt: Checkpoint, p: Path | None) -> str:
    if p is None:
        return ""
    try:
        return str(Path(p).relative_to(ckpt.path))
    except ValueError:
        return str(p)


def _layer_info(ckpt: Checkpoint, layer: QuantizedLayer) -> LayerInfo:
    arrays = list(layer.tensors.values()) + ([layer.bias] if layer.bias is not None else [])
    return LayerInfo(name=layer.name, format=layer.format, in_features=int(layer.in_features),
                     out_features=int(layer.out_features), group_size=int(layer.group_size),
                     config_group_size=int(layer.config_group_size),
                     nbytes=sum(int(a.nbytes) for a in arrays),   # memmap views: sizes without reading
                     has_bias=layer.bias is not None, dtypes=dict(layer.dtype_codes),
                     source=_relative(ckpt, layer.source))


def _tensor_summary(ckpt: Checkpoint, name: str) -> TensorSummary:
    info = ckpt.tensors.info(name)
    return TensorSummary(name=name, dtype=info.dtype, shape=tuple(int(d) for d in info.shape),
                         nbytes=int(info.nbytes), source=_relative(ckpt, ckpt.tensors.file(name)))


def _problem(rule: Rule, where: str, message: str, count: int = 1, index=None) -> Problem:
    return Problem(_SEVERITY.get(rule, Severity.ERROR), where, rule, message, int(count),
                   None if index is None else tuple(int(i) for i in index))


def _shown(names, limit: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _checkpoint_problems(ckpt: Checkpoint, caught) -> list[Problem]:
    """WARNING problems for what load_checkpoint warned about, rebuilt from the Checkpoint so that each names
    its module; recorded warnings these do not explain are kept with their own text."""
    qc, problems = ckpt.quant_config, []
    mismatched = sorted((n for n, layer in ckpt.layers.items() if layer.format != qc.version), key=_natural_key)
    if mismatched:
        found = sorted({ckpt.layers[n].format for n in mismatched})
        problems.append(_problem(
            Rule.FORMAT_MISMATCH, qc.source,
            f"the config says version {qc.version!r}, but {len(mismatched)} of {len(ckpt.layers)} layers have the "
            f"{'/'.join(found)} layout ({_shown(mismatched)}); the detected layout is used", len(mismatched)))

    by_module: dict[str, list[str]] = {}
    for name in ckpt.orphans:       # 1-D <act>.scales of scaled activations are not orphans (checkpoint.py)
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    for module in sorted(by_module, key=_natural_key):
        parts = by_module[module]
        short = [p.rpartition(".")[2] for p in parts]
        problems.append(_problem(
            Rule.ORPHAN_TENSOR, module or parts[0],
            f"holds {', '.join(short)} but no qweight, so it is not a quantized layer (a missing shard or a "
            f"renamed tensor?); the tensors are kept as plain tensors", len(parts)))
    refused: dict[int, list[str]] = {}
    for name, layer in ckpt.layers.items():
        try:
            check_group_size(int(layer.in_features), int(layer.group_size))
        except ValueError:
            refused.setdefault(int(layer.group_size), []).append(name)
    for G in sorted(refused):
        names = sorted(refused[G], key=_natural_key)
        problems.append(_problem(
            Rule.GROUP_SIZE_NOT_ON_GPU, names[0] if len(names) == 1 else str(ckpt.path),
            f"group size {G} ({len(names)} layer{'s' if len(names) > 1 else ''}: {_shown(names)}) is valid AWQ, but "
            f"the GPU kernels need a multiple of 32 or one group per layer: to_gpu refuses these layers "
            f"(awq_cupy.dequantize runs them on the CPU)", len(names)))
    if not ckpt.layers:
        problems.append(_problem(
            Rule.NO_QUANTIZED_LAYERS, str(ckpt.path),
            f"{qc.source} declares AWQ {qc.bits}-bit quantization, but no tensor is a quantized layer's qweight "
            f"({len(ckpt.tensors)} plain tensors)"))

    explained = (FormatMismatchWarning, OrphanTensorsWarning, NoQuantizedLayersWarning)   # rebuilt above
    for w in caught:
        text = str(w.message)
        if issubclass(w.category, explained):
            continue
        problems.append(_problem(Rule.CHECKPOINT_WARNING, str(ckpt.path), f"{w.category.__name__}: {text}"))
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The value scan: logical [NG, N] float32 views of one layer's scales and zeros

def _float32(a, code: str) -> np.ndarray:
    """float32 copy of a float tensor: F16, F32, BF16 as ml_dtypes or as uint16 bit patterns (exact)."""
    a = np.asarray(a)
    if a.dtype == np.uint16 or (code == "BF16" and a.dtype.kind in "iu"):
        return formats.bf16_bits_to_float32(a)
    return a.astype(np.float32)


def _round_to(x32: np.ndarray, code: str) -> np.ndarray:
    """float32 values rounded once to the storage dtype ``code``, as float32 (how the producers store SZ)."""
    if code == "F16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    if code == "BF16":
        return formats.bf16_bits_to_float32(formats.float32_to_bf16_bits(x32))
    return x32


def _logical_scales(layer: QuantizedLayer) -> np.ndarray:
    """S as float32 [NG, N] in logical (group, column) order, padding dropped
    (docs/formats.md §Layouts at a glance)."""
    fmt, K, G = layer.format, layer.in_features, layer.group_size
    NG = K // G
    s = layer.tensors["scales"]
    code = layer.dtype_codes.get("scales", "")
    if fmt == "gemv":                                  # [N, 8*ZW]
        return np.ascontiguousarray(_float32(s[:, :NG], code).T)
    S = _float32(s[:NG], code)                         # gemm [NG, N]; gemv_fast [8*ZW, N]; marlin [NG, N] permuted
    if fmt == "marlin":                                # stored chunks permuted (docs/formats.md §The marlin layout)
        S = formats._marlin_permute_scales(np, S, K, G, inverse=True)
    return S


def _nibbles(words, slot_of_element) -> np.ndarray:
    """uint8 [..., len(slot_of_element)]: element j from nibble slot slot_of_element[j] (unsigned view first:
    shifting a negative int32 drags in its sign bit)."""
    return formats._unpack_nibbles(np, np.ascontiguousarray(words).view(np.uint32), slot_of_element)


def _logical_zeros(layer: QuantizedLayer) -> np.ndarray:
    """Integer zero points uint8 [NG, N] of a gemm or gemv layer
    (docs/formats.md §The gemm layout, docs/formats.md §The gemv layout)."""
    K, N, G = layer.in_features, layer.out_features, layer.group_size
    NG = K // G
    qz = layer.tensors["qzeros"]
    if layer.format == "gemm":                         # [NG, N/8], column 8c + j in slot REV[j]
        return _nibbles(qz, formats.REV).reshape(NG, N)
    return np.ascontiguousarray(_nibbles(qz, range(8)).reshape(N, -1)[:, :NG].T)   # gemv [N, ZW], plain order


def _at(index) -> str:
    return f"group {index[0]}, column {index[1]}" if len(index) == 2 else f"column {index[0]}"


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask.ravel())), mask.shape))


def _v(x) -> str:
    return f"{float(x):.6g}"


def _nonfinite_problem(rule: Rule, where: str, what: str, values: np.ndarray) -> Problem | None:
    bad = ~np.isfinite(values)
    n = int(bad.sum())
    if not n:
        return None
    nan, pinf = int(np.isnan(values).sum()), int(np.isposinf(values).sum())
    idx = _first(bad)
    return _problem(rule, where, f"{n} of {values.size} {what} values are not finite ({nan} NaN, {pinf} +Inf, "
                                 f"{n - nan - pinf} -Inf); first at {_at(idx)}: {_v(values[idx])}", n, idx)


def _scan_layer(layer: QuantizedLayer, qc: QuantConfig) -> list[Problem]:
    try:
        return _check_layer(layer, qc)
    except Exception as e:    # an unreadable or inconsistent layer is one finding; the other layers still count
        return [_problem(Rule.UNREADABLE, layer.name,
                         f"its scales, zeros or bias cannot be read: {type(e).__name__}: {e}")]


def _check_layer(layer: QuantizedLayer, qc: QuantConfig) -> list[Problem]:
    name, out = layer.name, []
    S = _logical_scales(layer)
    p = _nonfinite_problem(Rule.NONFINITE_SCALE, name, "scale", S)
    if p:
        out.append(p)
    finite = np.isfinite(S)
    nonpos = finite & (S <= 0)
    n = int(nonpos.sum())
    if n:
        zeros = int((nonpos & (S == 0)).sum())
        idx = _first(nonpos)
        out.append(_problem(
            Rule.NONPOSITIVE_SCALE, name,
            f"{n} of {S.size} scales are <= 0 ({zeros} zero, {n - zeros} negative); first at {_at(idx)}: "
            f"{_v(S[idx])} (a zero scale collapses its group to 0; AutoAWQ never writes a negative one)", n, idx))
    usable = finite & (S > 0)                          # zero points are judged only where the scale is sound

    Z = None
    if layer.format == "gemv_fast":
        zname = "qzeros" if "qzeros" in layer.tensors else "scaled_zeros"
        code = layer.dtype_codes.get(zname, "")
        SZ = _float32(layer.tensors[zname][: S.shape[0]], code)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ratio = -SZ / np.where(usable, S, 1)
            Zf = np.rint(ratio)
            outside = usable & ~((Zf >= 0) & (Zf <= _MAX_CODE))        # NaN/Inf SZ land here too
            # producers store SZ = -(S*Z) rounded once (docs/formats.md §The gemv_fast layout): re-derive it
            inexact = usable & ~outside & (_round_to(-(S * Zf), code) != SZ)
        n = int(outside.sum())
        if n:
            idx = _first(outside)
            out.append(_problem(
                Rule.ZERO_OUT_OF_RANGE, name,
                f"{n} of {int(usable.sum())} implied zero points -{zname}/scales are outside 0..{_MAX_CODE} or not "
                f"finite; first at {_at(idx)}: -({_v(SZ[idx])}) / {_v(S[idx])} = {_v(ratio[idx])} (rounds to "
                f"{_v(Zf[idx])})", n, idx))
        n = int(inexact.sum())
        if n:
            idx = _first(inexact)
            out.append(_problem(
                Rule.ZERO_NOT_INTEGER, name,
                f"{n} of {int(usable.sum())} {zname} values are not -(scale * Z) rounded to {code} for an integer "
                f"Z (awq_cupy's conversion refuses them); first at {_at(idx)}: scale {_v(S[idx])}, {zname} "
                f"{_v(SZ[idx])}, -{zname}/scale = {_v(ratio[idx])}", n, idx))
        if not qc.zero_point:
            Z, valid = Zf, usable & ~outside & ~inexact
    elif layer.format in ("gemm", "gemv") and not qc.zero_point:
        Z, valid = _logical_zeros(layer), np.ones(S.shape, bool)
    if Z is not None:                                  # marlin has no zeros: symmetric by construction
        asym = valid & (Z != _SYMMETRIC_ZERO)
        n = int(asym.sum())
        if n:
            idx = _first(asym)
            out.append(_problem(
                Rule.ASYMMETRIC_ZERO, name,
                f"{qc.source} says zero_point false (symmetric: every zero point 8), but {n} of {Z.size} zero "
                f"points are not 8; first at {_at(idx)}: {int(Z[idx])}", n, idx))

    if layer.bias is not None:
        b = _float32(layer.bias, layer.dtype_codes.get("bias", ""))
        p = _nonfinite_problem(Rule.NONFINITE_BIAS, name, "bias", b)
        if p:
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Command line backend

def main(path, *, as_json: bool = False, scan: bool = True, stream: TextIO | None = None,
         progress: bool | Callable | None = None) -> int:
    """Print the report of ``path`` to ``stream`` (default: sys.stdout at call time) as text or, with
    ``as_json``, as ``json.dumps(report.to_dict(), indent=2)``. Returns 0 when there is no ERROR problem
    (warnings allowed), 1 when there is one, 2 when the checkpoint cannot be opened ("error: ..." on stderr)."""
    stream = sys.stdout if stream is None else stream
    try:
        report = inspect_checkpoint(path, scan=scan, progress=progress)
    except (CheckpointError, OSError) as e:            # OSError: a file that vanished or cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream.write(json.dumps(report.to_dict(), indent=2) + "\n" if as_json else report.format_text())
    stream.flush()
    return 0 if report.ok else 1

