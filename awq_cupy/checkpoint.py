"""AutoAWQ checkpoint I/O: ``load_checkpoint`` (any of the four formats, lazy) and ``save_checkpoint`` (gemm).

Reading (docs/formats.md §Config and version tags; docs/formats.md §Checkpoint pitfalls):

* ``path`` is a directory holding ``config.json`` with ``quantization_config`` (or an older
  ``quant_config.json`` / ``quantize_config.json``) and the weights: ``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``, or else every ``*.safetensors`` in the directory. ``path`` may also be one
  ``.safetensors`` file; its directory must hold the config.
* Only AWQ 4-bit is supported (``quant_method: awq``, ``bits: 4``); anything else is a ``CheckpointError``.
* A module is the tensor-name prefix before ``.qweight``. Its format is **detected** from the names, dtypes and
  shapes of its tensors (``formats.infer_shape``), not taken from the ``version`` tag. When the two disagree,
  detection wins and one ``FormatMismatchWarning`` lists the modules. Every tensor is then checked against the
  shape its format implies for (K, N, group_size from the config); mismatches name the file and the tensor.
* Modules matched by ``modules_to_not_convert`` (substring match, like AutoAWQ) must not be quantized; if one
  holds ``qweight`` anyway the checkpoint is rejected.
* Everything else is passed through untouched in ``Checkpoint.tensors`` (a lazy mapping).

Laziness: opening reads only the safetensors headers. Tensors are read-only ``np.memmap`` views that read
from disk when used, so a 40 GB checkpoint opens in milliseconds and costs no RAM up front. BF16 tensors follow
``bf16=`` (see ``safetensors_io``): ml_dtypes arrays when available, else uint16 bit patterns.

Progress: ``progress=True`` prints a stderr progress line per shard opened or written, ``False`` prints
nothing, a callable receives ``(done, total, description)``. The default (None) prints only when stderr is a
terminal and the checkpoint holds at least 2 GiB of weights.

Writing: ``save_checkpoint`` always writes AutoAWQ's interoperable ``gemm`` layout, converting layers given in
any format, with a transformers-style ``config.json`` (docs/formats.md §Converting and writing). Sharded output
follows the Hugging Face naming (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``).
"""
from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from . import formats
from ._array import is_bfloat16, make_reporter, to_numpy
from .quantize import QuantizedTensors
from .safetensors_io import SafetensorsError, SafetensorsFile, TensorInfo, dtype_code_of, write_file

__all__ = [
    "CheckpointError", "CheckpointWarning", "FormatMismatchWarning", "OrphanTensorsWarning",
    "NoQuantizedLayersWarning", "QuantConfig", "QuantizedLayer", "LazyTensors",
    "Checkpoint", "PendingLayer", "load_checkpoint", "save_checkpoint",
]

CONFIG_FILE = "config.json"
OLD_CONFIG_FILES = ("quant_config.json", "quantize_config.json")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# version tags -> on-disk format. exllama/exllamav2/ipex are load-time kernel choices over gemm files
# (docs/formats.md §Config and version tags).
_VERSION_ALIASES = {
    "gemm": "gemm", "gemv": "gemv", "gemv_fast": "gemv_fast", "gemvfast": "gemv_fast", "marlin": "marlin",
    "exllama": "gemm", "exllamav2": "gemm", "ipex": "gemm",
}
_ZERO_NAMES = ("qzeros", "scaled_zeros")        # AutoAWQ / llm-awq (docs/formats.md §The gemv_fast layout)
_LAYER_PARTS = ("qweight",) + _ZERO_NAMES + ("scales",)
_FLOAT_CODES = ("F16", "BF16", "F32")
AUTO_PROGRESS_BYTES = 2 << 30                 # default progress only for checkpoints of at least 2 GiB


class CheckpointError(ValueError):
    """A checkpoint cannot be read: missing or corrupted files, unsupported config, inconsistent tensors."""


class CheckpointWarning(UserWarning):
    """A checkpoint loads, but something in it is probably not what its writer meant (tensors of a quantized
    layer without their ``qweight``, a quantized config with no quantized layer)."""


class FormatMismatchWarning(CheckpointWarning):
    """The ``version`` tag of a checkpoint disagrees with the layout its tensors actually have."""


class OrphanTensorsWarning(CheckpointWarning):
    """Tensors named like parts of a quantized layer (``qzeros``, ``scaled_zeros``, 2-D ``scales``) whose module
    has no ``qweight``: a missing shard or a renamed tensor. ``Checkpoint.orphans`` lists them."""


class NoQuantizedLayersWarning(CheckpointWarning):
    """The config declares AWQ quantization, but no tensor is a quantized layer's ``qweight``."""


# ---------------------------------------------------------------------------------------------------------------
# Config

@dataclass(frozen=True)
class QuantConfig:
    """Normalised AWQ quantization config. ``group_size`` is as written (-1 = one group per row);
    ``version`` is lower-case and mapped to an on-disk format (``exllama``/``ipex`` -> ``gemm``)."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()
    quant_method: str = "awq"
    source: str = CONFIG_FILE                   # the file the values came from

    @classmethod
    def from_dict(cls, d: Mapping, source: str = CONFIG_FILE) -> "QuantConfig":
        if not isinstance(d, Mapping):
            raise CheckpointError(f"{source}: quantization config must be a JSON object, got {type(d).__name__}")
        method = str(d.get("quant_method", "awq")).lower()
        if method != "awq":
            raise CheckpointError(
                f"{source}: quant_method {method!r} is not supported; awq_cupy reads AutoAWQ 4-bit checkpoints "
                f"(quant_method 'awq'). llm-compressor's compressed-tensors and other methods are out of scope")
        bits = d.get("bits", d.get("w_bit", 4))
        if bits != 4:
            raise CheckpointError(f"{source}: bits={bits!r} is not supported; only 4-bit AWQ is")
        group_size = d.get("group_size", d.get("q_group_size", 128))
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise CheckpointError(f"{source}: group_size={group_size!r} must be -1 or a positive int")
        zero_point = d.get("zero_point", True)
        if not isinstance(zero_point, bool):
            raise CheckpointError(f"{source}: zero_point={zero_point!r} must be true or false")
        raw_version = d.get("version") or "gemm"     # missing means gemm (docs/formats.md §Config and version tags)
        version = _VERSION_ALIASES.get(str(raw_version).lower())
        if version is None:
            raise CheckpointError(
                f"{source}: unknown AWQ version {raw_version!r}; known: {sorted(_VERSION_ALIASES)}")
        skip = d.get("modules_to_not_convert") or ()
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise CheckpointError(f"{source}: modules_to_not_convert must be a list of strings, got {skip!r}")
        return cls(bits=bits, group_size=group_size, zero_point=zero_point, version=version,
                   modules_to_not_convert=tuple(skip), quant_method=method, source=source)

    def excludes(self, module: str) -> bool:
        """True when ``module`` matches ``modules_to_not_convert`` (substring match, as in AutoAWQ)."""
        return any(s in module for s in self.modules_to_not_convert)

    def to_dict(self) -> dict:
        """The ``quantization_config`` dict AutoAWQ / transformers write."""
        return {"quant_method": self.quant_method, "version": self.version, "bits": self.bits,
                "group_size": self.group_size, "zero_point": self.zero_point,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}


def read_json(path: Path):
    """A JSON file's content; a clear CheckpointError naming the file when it cannot be read (also convert's)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e


def _read_config(d: Path) -> tuple[dict, QuantConfig]:
    config = {}
    if (d / CONFIG_FILE).is_file():
        config = read_json(d / CONFIG_FILE)
        if not isinstance(config, dict):
            raise CheckpointError(f"{d / CONFIG_FILE}: must hold a JSON object")
        if config.get("quantization_config") is not None:
            return config, QuantConfig.from_dict(config["quantization_config"], str(d / CONFIG_FILE))
    for name in OLD_CONFIG_FILES:
        if (d / name).is_file():
            return config, QuantConfig.from_dict(read_json(d / name), str(d / name))
    found = "config.json has no 'quantization_config'" if (d / CONFIG_FILE).is_file() else "no config.json"
    raise CheckpointError(
        f"{d}: missing quantization config ({found}, and no {' / '.join(OLD_CONFIG_FILES)}); "
        f"is this an AWQ checkpoint?")


# ---------------------------------------------------------------------------------------------------------------
# Loaded objects

@dataclass(frozen=True, eq=False)
class QuantizedLayer:
    """One quantized linear as stored on disk.

    ``tensors`` holds ``qweight``, ``qzeros`` or ``scaled_zeros`` (absent for marlin) and ``scales`` under
    those short names, as read-only arrays in the layer's own ``format`` (bias is separate). ``group_size`` is
    resolved (-1 -> K); ``config_group_size`` is the config's value. ``dtype_codes`` gives each tensor's declared
    safetensors dtype (BF16 tensors are uint16 bit patterns when ml_dtypes is unavailable).
    """

    name: str
    format: str
    in_features: int
    out_features: int
    group_size: int
    config_group_size: int
    tensors: Mapping[str, Any]
    bias: Any = None
    dtype_codes: Mapping[str, str] = field(default_factory=dict)
    source: Path | None = None                 # the file holding qweight

    @property
    def K(self) -> int:
        return self.in_features

    @property
    def N(self) -> int:
        return self.out_features

    def unpack(self) -> QuantizedTensors:
        """Logical Q [K, N], Z [K/G, N], S [K/G, N] (reads the data)."""
        Q, Z, S = formats.unpack(self.tensors, self.format, self.in_features, self.config_group_size)
        return QuantizedTensors(Q, Z, S, self.group_size)

    def dequantize(self, dtype=np.float16):
        """Dense ``W [K, N]`` on the CPU (numpy): ``(q - z) * s`` in float32, rounded once to ``dtype``. No GPU
        needed; reads the layer's data. ``awq_cupy.dequantize(layer)`` is the same call."""
        return self.unpack().dequantize(dtype)

    def to_gemm(self) -> dict:
        """``qweight``/``qzeros``/``scales`` in the gemm layout (the stored arrays themselves if already gemm)."""
        if self.format == "gemm":
            return {k: self.tensors[k] for k in ("qweight", "qzeros", "scales")}
        return formats.to_gemm(dict(self.tensors), self.format, self.in_features, self.config_group_size)

    def __repr__(self):
        return (f"QuantizedLayer({self.name!r}, format={self.format!r}, K={self.in_features}, "
                f"N={self.out_features}, group_size={self.group_size}, bias={self.bias is not None})")


class LazyTensors(Mapping):
    """Read-only name -> array mapping over safetensors files; an array is mapped when it is looked up."""

    def __init__(self, where: Mapping[str, SafetensorsFile]):
        self._where = dict(where)

    def __getitem__(self, name: str):
        try:
            f = self._where[name]
        except KeyError:
            raise KeyError(name) from None
        return f.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].info(name)

    def dtype_code(self, name: str) -> str:
        """Declared safetensors dtype (``"BF16"`` even when the array is uint16 bit patterns)."""
        return self._where[name].dtype_code(name)

    def file(self, name: str) -> Path:
        return self._where[name].path

    def __repr__(self):
        return f"LazyTensors({len(self)} tensors)"


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """An opened AWQ checkpoint; see ``load_checkpoint``."""

    path: Path                                  # the directory
    config: dict                                # config.json as read (may be {} with an old-style config)
    quant_config: QuantConfig
    layers: dict[str, QuantizedLayer]
    tensors: LazyTensors                        # everything that is not part of a quantized layer
    files: tuple[Path, ...]                     # the safetensors files, in load order
    _handles: tuple[SafetensorsFile, ...] = field(default=(), repr=False)
    # names in ``tensors`` that look like parts of a quantized layer (qzeros/scaled_zeros/2-D scales) whose
    # module has no qweight: left as plain tensors, and warned about at load time (OrphanTensorsWarning)
    orphans: tuple[str, ...] = ()

    def to_gpu(self, *, dtype="float16", device=None, fuse=False, names=None, progress=None,
               validate: bool = True) -> dict:
        """Every quantized layer as a ``QuantizedWeight`` on the GPU: ``{module name: weight}`` (biases kept as
        ``weight.bias``). See ``awq_cupy.loading.to_gpu`` for the options, fusion included."""
        from .loading import to_gpu

        return to_gpu(self, dtype=dtype, device=device, fuse=fuse, names=names, progress=progress,
                      validate=validate)

    def close(self):
        """Drop the file mappings held by this object (arrays already handed out keep theirs alive)."""
        for sf in self._handles:
            sf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        fmts = sorted({layer.format for layer in self.layers.values()})
        return (f"Checkpoint({str(self.path)!r}, {len(self.layers)} quantized layers {fmts}, "
                f"{len(self.tensors)} other tensors, {len(self.files)} file(s))")

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized layers' tensors on disk (packed weights, zeros, scales, biases)."""
        total = 0
        for layer in self.layers.values():
            arrays = list(layer.tensors.values()) + ([layer.bias] if layer.bias is not None else [])
            total += sum(int(a.nbytes) for a in arrays)
        return total


# ---------------------------------------------------------------------------------------------------------------
# Loading

def _make_progress(progress, total_bytes: int) -> Callable[[int, int, str], None] | None:
    return make_reporter(progress, total_bytes >= AUTO_PROGRESS_BYTES)


def weight_files(d: Path) -> tuple[list[Path], dict | None, Path | None]:
    """(files, weight_map or None, index path or None) following transformers' preference order."""
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE], None, None
    index = d / INDEX_FILE
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            if not isinstance(shard, str) or not (d / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard!r} listed in weight_map is missing from {d}")
            files.append(d / shard)
        return files, weight_map, index
    files = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{d}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")
    return files, None, None


def open_weight_file(path: Path, bf16: str) -> SafetensorsFile:
    """One .safetensors file (``bf16`` as for SafetensorsFile); a malformed file as a CheckpointError."""
    try:
        return SafetensorsFile(path, bf16=bf16)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e


def load_checkpoint(path, *, progress=None, bf16: str = "auto") -> Checkpoint:
    """Open an AWQ checkpoint lazily (see the module docstring). Raises ``CheckpointError`` on bad input."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p}: expected a directory or a .safetensors file")
        d, (files, weight_map, index) = p.parent, ([p], None, None)
    else:
        d = p
        files, weight_map, index = weight_files(d)
    config, qc = _read_config(d)

    report = _make_progress(progress, sum(f.stat().st_size for f in files))
    opened: list[SafetensorsFile] = []
    for i, f in enumerate(files):
        opened.append(open_weight_file(f, bf16))
        if report:
            report(i + 1, len(files), f"opening {f.name}")

    where: dict[str, SafetensorsFile] = {}
    if weight_map is not None:
        by_name = dict(zip(dict.fromkeys(weight_map.values()), opened))   # same order as weight_files
        for name, shard in weight_map.items():
            if name not in by_name[shard]:
                raise CheckpointError(f"{index}: weight_map puts {name!r} in {shard}, but that file has no such tensor")
            where[name] = by_name[shard]
    for sf in opened:
        for name in sf.keys():
            if name in where:
                if weight_map is None:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name].path} and {sf.path}")
                continue
            where[name] = sf

    layers, consumed, mismatched = {}, set(), []
    for qname in [n for n in where if n == "qweight" or n.endswith(".qweight")]:
        prefix = qname[: -len("qweight")]
        module = prefix.rstrip(".")
        layer = _load_layer(module, prefix, where, qc)
        consumed.update(prefix + part for part in (*layer.tensors, "bias") if prefix + part in where)
        layers[module] = layer
        if layer.format != qc.version:
            mismatched.append(module)
    if mismatched:
        shown = ", ".join(repr(m) for m in mismatched[:3]) + (" ..." if len(mismatched) > 3 else "")
        found = sorted({layers[m].format for m in mismatched})
        warnings.warn(
            f"{qc.source} says version {qc.version!r}, but the tensors of {len(mismatched)} module(s) ({shown}) "
            f"have the {'/'.join(found)} layout; using the detected layout", FormatMismatchWarning, stacklevel=2)

    others = LazyTensors({n: sf for n, sf in where.items() if n not in consumed})
    # AutoAWQ's scaled activations (bloom, falcon, mpt) store a 1-D ``<act>.scales`` on purpose
    # (docs/formats.md §Checkpoint pitfalls): only 2-D scales are a layer's remains.
    orphans = tuple(n for n in others if n.rsplit(".", 1)[-1] in _ZERO_NAMES
                    or (n.rsplit(".", 1)[-1] == "scales" and len(others.info(n).shape) == 2))
    if orphans:
        shown = ", ".join(repr(n) for n in orphans[:3]) + (" ..." if len(orphans) > 3 else "")
        warnings.warn(
            f"{d}: {len(orphans)} tensor(s) look like parts of a quantized layer but their module has no qweight "
            f"({shown}); they are kept as plain tensors (Checkpoint.orphans lists them)", OrphanTensorsWarning,
            stacklevel=2)
    if not layers:
        warnings.warn(
            f"{d}: {qc.source} declares AWQ {qc.bits}-bit quantization, but no tensor is a quantized layer's "
            f"qweight: nothing in this checkpoint is quantized", NoQuantizedLayersWarning, stacklevel=2)
    return Checkpoint(path=d, config=config, quant_config=qc, layers=layers, tensors=others, files=tuple(files),
                      _handles=tuple(opened), orphans=orphans)


def _describe(parts: Mapping[str, SafetensorsFile], prefix: str) -> str:
    return ", ".join(f"{k} {parts[k].dtype_code(prefix + k)} {list(parts[k].info(prefix + k).shape)}"
                     for k in parts)


def _load_layer(module: str, prefix: str, where: Mapping[str, SafetensorsFile], qc: QuantConfig) -> QuantizedLayer:
    files = {part: where[prefix + part] for part in _LAYER_PARTS if prefix + part in where}
    qfile = files["qweight"].path
    label = f"module {module!r} ({qfile})"
    if qc.excludes(module):
        raise CheckpointError(
            f"{label} holds {prefix}qweight but matches modules_to_not_convert {list(qc.modules_to_not_convert)} "
            f"in {qc.source}; such modules must stay unquantized")
    if "scales" not in files:
        raise CheckpointError(f"{label}: quantized module is missing tensor {prefix}scales")
    zero_names = [z for z in _ZERO_NAMES if z in files]
    if len(zero_names) > 1:
        raise CheckpointError(f"{label}: holds both {prefix}qzeros and {prefix}scaled_zeros; expected one")

    tensors = {part: sf.get(prefix + part) for part, sf in files.items()}
    codes = {part: sf.dtype_code(prefix + part) for part, sf in files.items()}
    try:
        fmt, K, N = formats.infer_shape(tensors, group_size=None)
    except (formats.FormatError, ValueError, KeyError, NotImplementedError) as e:
        if not zero_names:
            raise CheckpointError(
                f"{label}: missing tensor {prefix}qzeros (found {_describe(files, prefix)}; only marlin layers have "
                f"no zeros)") from e
        raise CheckpointError(f"{label}: unknown AWQ layout ({_describe(files, prefix)}): {e}") from e
    if fmt not in formats.FORMATS:
        raise CheckpointError(f"{label}: unknown format {fmt!r}")
    if fmt != "marlin" and not zero_names:
        raise CheckpointError(f"{label}: {fmt} layer is missing tensor {prefix}qzeros")
    if fmt == "marlin" and zero_names:
        raise CheckpointError(f"{label}: marlin layers have no zeros, but {prefix}{zero_names[0]} is present")

    try:
        G = int(formats.resolve_group_size(qc.group_size, K))
        expected = _expected_layout(fmt, K, N, G)
    except (formats.FormatError, ValueError, NotImplementedError) as e:
        raise CheckpointError(f"{label}: group_size={qc.group_size} from {qc.source} does not fit K={K}: {e}") from e
    for part, sf in files.items():
        key = "zeros" if part in _ZERO_NAMES else part
        codes_ok, shape = expected[key]
        info = sf.info(prefix + part)
        if info.shape != shape or info.dtype not in codes_ok:
            raise CheckpointError(
                f"{sf.path}: tensor {prefix + part!r} is {info.dtype} {list(info.shape)}, but a {fmt} layer with "
                f"K={K}, N={N}, group_size={qc.group_size} needs {'/'.join(codes_ok)} {list(shape)}")

    bias = None
    if prefix + "bias" in where:
        bf = where[prefix + "bias"]
        info = bf.info(prefix + "bias")
        if info.shape != (N,) or info.dtype not in _FLOAT_CODES:
            raise CheckpointError(f"{bf.path}: tensor {prefix + 'bias'!r} is {info.dtype} {list(info.shape)}, "
                                  f"expected a float vector of out_features N={N}")
        bias = bf.get(prefix + "bias")
        codes["bias"] = info.dtype
    return QuantizedLayer(name=module, format=fmt, in_features=K, out_features=N, group_size=G,
                          config_group_size=qc.group_size, tensors=tensors, bias=bias, dtype_codes=codes,
                          source=qfile)


# allowed declared dtypes per format and tensor (docs/formats.md §Layouts at a glance); shapes come from
# formats.packed_shapes
_PART_CODES = {
    "gemm": {"qweight": ("I32",), "zeros": ("I32",), "scales": _FLOAT_CODES},
    "gemv": {"qweight": ("I32",), "zeros": ("I32",), "scales": _FLOAT_CODES},
    "gemv_fast": {"qweight": ("I16",), "zeros": _FLOAT_CODES, "scales": _FLOAT_CODES},
    "marlin": {"qweight": ("I32",), "scales": _FLOAT_CODES},
}


def _expected_layout(fmt: str, K: int, N: int, G: int) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Allowed dtype codes and shape of each tensor of a layer; the zero tensor is listed as ``zeros``."""
    shapes = formats.packed_shapes(fmt, K, N, G)
    return {("zeros" if k == "qzeros" else k): (_PART_CODES[fmt]["zeros" if k == "qzeros" else k], tuple(v))
            for k, v in shapes.items()}


# ---------------------------------------------------------------------------------------------------------------
# Saving

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(size) -> int:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size > 0:
        return int(size)
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        if m and m.group(2).upper() in _SIZE_UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    raise ValueError(f"max_shard_size={size!r} must be a positive byte count or a string like '5GB' / '2GiB'")


@dataclass(frozen=True, eq=False)
class PendingLayer:
    """A layer for ``save_checkpoint`` that is computed only when it is written: ``produce()`` returns its
    ``QuantizedTensors`` (Q [K, N] with ``group_size``). Converting a dense checkpoint this way holds one layer
    in host memory at a time instead of the whole model."""

    in_features: int
    out_features: int
    group_size: int
    produce: Callable[[], QuantizedTensors]


class _LayerUnit:
    """A layer to write as gemm: shapes known up front, converted when its first tensor is written."""

    def __init__(self, name, layer, group_size, zero_point, bias):
        self.name, self.layer, self.group_size, self.zero_point, self.bias = name, layer, group_size, zero_point, bias
        if isinstance(layer, QuantizedTensors):
            K, N = (int(d) for d in layer.Q.shape)
            G, self.fmt = int(layer.group_size), None
        elif isinstance(layer, PendingLayer):
            K, N, G, self.fmt = layer.in_features, layer.out_features, layer.group_size, None
        elif isinstance(layer, QuantizedLayer):
            K, N, G, self.fmt = layer.in_features, layer.out_features, layer.group_size, layer.format
            if layer.bias is not None:
                self.bias = self._one_bias(self.bias, layer.bias)
        elif isinstance(layer, Mapping):
            parts = {k: layer[k] for k in _LAYER_PARTS if k in layer}
            unknown = set(layer) - set(_LAYER_PARTS) - {"bias"}
            if unknown:
                raise ValueError(f"layer {name!r}: unexpected tensors {sorted(unknown)}")
            if "bias" in layer:
                self.bias = self._one_bias(self.bias, layer["bias"])
            try:
                self.fmt, K, N = formats.infer_shape(parts, group_size=group_size)
            except (formats.FormatError, KeyError) as e:
                raise ValueError(f"layer {name!r}: cannot tell the AWQ layout of its tensors: {e}") from e
            self.parts = parts
            G = int(formats.resolve_group_size(group_size, int(K)))
        else:
            raise TypeError(f"layer {name!r}: expected QuantizedTensors, QuantizedLayer, PendingLayer or a dict of "
                            f"packed tensors, got {type(layer).__name__}")
        K, N = int(K), int(N)
        G_cfg = int(formats.resolve_group_size(group_size, K))
        if G != G_cfg:
            raise ValueError(f"layer {name!r}: its group size {G} differs from {group_size=} (= {G_cfg} for {K=})")
        if N % 8:
            raise ValueError(f"layer {name!r}: out_features {N=} is not a multiple of 8")
        if self.bias is not None and tuple(self.bias.shape) != (N,):
            raise ValueError(f"layer {name!r}: bias shape {tuple(self.bias.shape)} is not ({N},)")
        self.K, self.N, self.G = K, N, G
        NG = K // G
        p = f"{name}." if name else ""
        self.specs = [(p + "qweight", "I32", (K, N // 8)), (p + "qzeros", "I32", (NG, N // 8)),
                      (p + "scales", "F16", (NG, N))]
        if self.bias is not None:
            self.specs.append((p + "bias", "F16", (N,)))
        self.nbytes = 4 * K * (N // 8) + 4 * NG * (N // 8) + 2 * NG * N + (2 * N if self.bias is not None else 0)
        self._cache = None

    def _one_bias(self, given, found):
        if given is not None:
            raise ValueError(f"layer {self.name!r}: bias given twice (in other_tensors and with the layer)")
        return found

    def produce(self, full_name: str):
        if self._cache is None:
            self._cache = self._convert()
        short = full_name.rsplit(".", 1)[-1]
        out = self._cache.pop(short)
        if not self._cache:
            self._cache = None                  # all written: free the converted arrays
        return out

    def _convert(self) -> dict:
        if isinstance(self.layer, (QuantizedTensors, PendingLayer)):
            qt = self.layer if isinstance(self.layer, QuantizedTensors) else self.layer.produce()
            if not isinstance(qt, QuantizedTensors) or tuple(qt.Q.shape) != (self.K, self.N) or qt.group_size != self.G:
                raise ValueError(f"layer {self.name!r}: its PendingLayer produced {type(qt).__name__} that is not "
                                 f"QuantizedTensors with Q [{self.K}, {self.N}] and group_size {self.G}")
            t = formats.pack(to_numpy(qt.Q), to_numpy(qt.Z), to_numpy(qt.S), "gemm", self.G)
        else:
            src = self.layer.tensors if isinstance(self.layer, QuantizedLayer) else self.parts
            src = {k: to_numpy(v) for k, v in src.items()}
            if self.fmt == "gemm" and src["scales"].dtype == np.float16:
                t = src                         # already what we write (int32/uint32 words are reinterpreted)
            else:                               # other layouts, and bf16/fp32 scales (converted exactly or refused)
                t = formats.to_gemm(src, self.fmt, self.K, self.group_size)
        out = {k: np.asarray(t[k]) for k in ("qweight", "qzeros", "scales")}
        for k in ("qweight", "qzeros"):
            out[k] = out[k].view(np.int32)      # int32 or uint32 bit containers (formats checked the dtype)
        if not self.zero_point and not bool((out["qzeros"].view(np.uint32) == np.uint32(0x88888888)).all()):
            raise ValueError(f"layer {self.name!r}: zero_point=False needs every zero point to be 8 (symmetric), "
                             "but this layer has others")
        if self.bias is not None:
            out["bias"] = _bias_fp16(np.asarray(to_numpy(self.bias)), self.name)
        return out


def _bias_fp16(a, name):
    """Bias as float16 (AutoAWQ's dtype). uint16 is read as bfloat16 bit patterns, like everywhere else."""
    if a.dtype == np.float16:
        return a
    if a.dtype == np.uint16:
        a = formats.bf16_bits_to_float32(a)
    elif a.dtype.kind != "f" and not is_bfloat16(a.dtype):
        raise TypeError(f"layer {name!r}: bias must be a float array, got {a.dtype}")
    with np.errstate(over="ignore"):
        out = a.astype(np.float16)
    if not bool(np.isfinite(out).all()) and bool(np.isfinite(a.astype(np.float32)).all()):
        raise ValueError(f"layer {name!r}: bias overflows float16 (AWQ gemm stores float16)")
    return out


class _TensorUnit:
    def __init__(self, name, source, code):
        arr = source[name]
        self.specs = [(name, code, tuple(int(d) for d in arr.shape))]
        self.nbytes = int(arr.dtype.itemsize * math.prod(arr.shape))
        self.itemsize = arr.dtype.itemsize
        self._source = source

    def produce(self, name):
        return self._source[name]


def stale_files(d: Path) -> list[Path]:
    """The checkpoint files in ``d`` that writing a checkpoint there replaces: weights, index, config, shards."""
    out = [d / n for n in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) if (d / n).exists()]
    return out + sorted(p for p in d.glob("model-*-of-*.safetensors") if _SHARD_RE.fullmatch(p.name))


def save_checkpoint(path, layers: Mapping[str, Any], other_tensors: Mapping[str, Any] | None = None, *,
                    group_size: int, config: Mapping | None = None, zero_point: bool = True,
                    modules_to_not_convert=None, max_shard_size=None, overwrite: bool = False,
                    progress=None) -> Path:
    """Write an AutoAWQ-compatible **gemm** checkpoint into directory ``path``; returns that directory.

    ``layers``: module name -> ``QuantizedTensors`` (from ``quantize``), ``QuantizedLayer`` (from
    ``load_checkpoint``, any format), ``PendingLayer`` (computed when written) or a dict of packed tensors in
    any format (``qweight``, ``qzeros`` or ``scaled_zeros``, ``scales``, optional ``bias``; the format is
    detected). Every layer must use ``group_size``
    (the config value; -1 = one group). A layer's bias may also come as ``other_tensors["<name>.bias"]``.
    ``other_tensors``: passed through unchanged (numpy/cupy arrays or a ``Checkpoint.tensors`` mapping, whose
    BF16 tensors keep their dtype even as uint16 bit patterns).
    Written per layer: ``<name>.qweight`` int32 [K, N/8], ``<name>.qzeros`` int32 [K/G, N/8], ``<name>.scales``
    fp16 [K/G, N], ``<name>.bias`` fp16 [N]; ``config.json`` = ``config`` with ``quantization_config`` set to
    ``{quant_method: awq, version: gemm, bits: 4, group_size, zero_point, modules_to_not_convert}``.
    ``max_shard_size`` (bytes or ``"5GB"``): shard when the weights exceed it (a layer never straddles shards).
    Existing checkpoint files in ``path`` are a FileExistsError unless ``overwrite=True``, which deletes them.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{group_size=} must be -1 or a positive int")
    if not isinstance(zero_point, bool):
        raise TypeError(f"zero_point must be a bool, got {type(zero_point).__name__}")
    skip = tuple(modules_to_not_convert or ())
    if isinstance(modules_to_not_convert, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError("modules_to_not_convert must be a list of strings")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    other_tensors = {} if other_tensors is None else other_tensors
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{d} exists and is not a directory")

    qc = QuantConfig(bits=4, group_size=group_size, zero_point=zero_point, version="gemm",
                     modules_to_not_convert=skip)
    units, used_bias = [], set()
    for name, layer in layers.items():
        if qc.excludes(name):
            raise ValueError(f"layer {name!r} matches modules_to_not_convert {list(skip)}; it cannot be quantized")
        bias_name = f"{name}.bias" if name else "bias"
        bias = other_tensors[bias_name] if bias_name in other_tensors else None
        if bias is not None:
            used_bias.add(bias_name)
        units.append(_LayerUnit(name, layer, group_size, zero_point, bias))
    layer_names = {s[0] for u in units for s in u.specs}
    code_of = getattr(other_tensors, "dtype_code", None)
    others = []
    for name in other_tensors:
        if name in used_bias:
            continue
        if name in layer_names:
            raise ValueError(f"other_tensors[{name!r}] collides with a tensor of a quantized layer")
        arr = other_tensors[name]
        others.append(_TensorUnit(name, other_tensors, code_of(name) if code_of else dtype_code_of(arr.dtype)))

    # Order for natural alignment: 8-byte tensors, then layers (each a multiple of 4 bytes: int32 first, then
    # fp16), then 4-, 2- and 1-byte tensors. Shards are filled greedily in this order.
    ordered = ([u for u in others if u.itemsize >= 8] + units
               + sorted((u for u in others if u.itemsize < 8), key=lambda u: -u.itemsize))
    shards: list[list] = [[]]
    size = 0
    for u in ordered:
        if limit is not None and shards[-1] and size + u.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.nbytes

    d.mkdir(parents=True, exist_ok=True)
    stale = stale_files(d)
    if stale and not overwrite:
        raise FileExistsError(f"{d} already holds {', '.join(p.name for p in stale)}; pass overwrite=True")
    for p in stale:
        p.unlink()

    report = _make_progress(progress, sum(u.nbytes for u in ordered))
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for i, (fname, shard) in enumerate(zip(names, shards)):
        owner = {s[0]: u for u in shard for s in u.specs}
        total += write_file(d / fname, [s for u in shard for s in u.specs], lambda n: owner[n].produce(n),
                            {"format": "pt"})
        weight_map.update({n: fname for n in owner})
        if report:
            report(i + 1, len(shards), f"writing {fname}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_text(d / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    out_config = dict(config or {})
    out_config["quantization_config"] = qc.to_dict()
    _write_text(d / CONFIG_FILE, json.dumps(out_config, indent=2) + "\n")
    return d


def _write_text(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
