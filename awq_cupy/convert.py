"""``convert_checkpoint``: turn a model folder into an interoperable AutoAWQ ``gemm`` checkpoint (the backend of
``awq-cupy convert``).

Why a converter: awq_cupy reads four AWQ layouts, but vLLM, transformers and most tools load only ``gemm``
(docs/formats.md §Converting and writing), and a dense model has to be quantized before any of them runs it in
4 bits. Two kinds of input, told apart by their config:

* **AWQ** (``config.json`` with ``quantization_config``, or an old ``quant_config.json``): any of gemm, gemv,
  gemv_fast and marlin. Rewriting as gemm is lossless (docs/formats.md §Converting and writing), so the
  checkpoint's group size and zero point are kept; asking for another group size is refused, since regrouping
  quantized weights would mean re-quantizing already rounded values.
* **Dense** (``config.json`` without one, plus safetensors weights): every linear weight is quantized by
  round-to-nearest with AutoAWQ's semantics (docs/formats.md §Quantizer). That is plain RTN, not the
  activation-aware search (``awq_cupy.awq``), which needs calibration data and a forward pass.

Which dense weights are quantized: 2-D F16/BF16/F32 tensors ``<module>.weight`` that are linear layers (not an
embedding, output head, norm or mixture-of-experts router: ``DENSE_KEEP``), not matched by a ``skip`` pattern,
with ``N % 8 == 0``, ``K % 8 == 0``, ``K % G == 0`` and a group size the kernels run
(docs/formats.md §Group sizes). Every other tensor is copied unchanged. Linear modules left dense for their
shape, dtype or as a router are written into ``modules_to_not_convert`` with the skip patterns: transformers and
vLLM would otherwise replace them by quantized linears and find no ``qweight``.

Memory: dense layers go to ``save_checkpoint`` as ``PendingLayer`` objects, so each weight is read from its
memory map and quantized only when its turn to be written comes; host memory holds about one layer at a time.

Side files (tokenizer, generation config, chat template, custom code, ...) are copied after the checkpoint is
written; weights in any format, weight indexes and the old configs are not. Nothing in the destination is
replaced without ``overwrite``, and that is checked before anything is written.
"""
from __future__ import annotations

import dataclasses
import filecmp
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

from . import formats
from ._array import make_reporter
from .checkpoint import (
    AUTO_PROGRESS_BYTES, CONFIG_FILE, OLD_CONFIG_FILES, Checkpoint, CheckpointError, LazyTensors, PendingLayer,
    QuantConfig, open_weight_file, read_json, stale_files, weight_files, load_checkpoint, save_checkpoint,
)
from .quantize import QuantizedTensors, quantize
from .safetensors_io import SafetensorsFile

__all__ = ["SourceKind", "KeepRule", "DENSE_KEEP", "UnquantizedWeight", "ConvertResult", "DEFAULT_GROUP_SIZE",
           "convert_checkpoint", "main", "summary_lines"]

DEFAULT_GROUP_SIZE = 128                       # AutoAWQ's default for dense input
_QUANTIZABLE_CODES = ("F16", "BF16", "F32")
# Never copied as side files: weights of any framework (the new ones are written), and configs/indexes that
# the written checkpoint replaces. Hidden files (.gitattributes, caches) are VCS/tool state, not model files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".tmp")
_REPLACED_FILES = (CONFIG_FILE, *OLD_CONFIG_FILES)
_MAX_LISTED = 20                               # unquantized weights printed by main() before "... and N more"

Reporter = Callable[[int, int, str], None]


class SourceKind(Enum):
    """What ``convert_checkpoint`` found in the source folder."""

    AWQ = "awq"                                # an AWQ checkpoint: rewritten as gemm, losslessly
    DENSE = "dense"                            # an unquantized model: quantized by round-to-nearest


@dataclass(frozen=True)
class KeepRule:
    """Dense weights that stay unquantized by name: a module matches when ``"." + module + "."`` contains one of
    ``patterns`` (so ``".gate."`` is the whole last name part ``gate``, not ``gate_proj``). ``linear`` says
    whether such a module is an ``nn.Linear`` that loaders would quantize unless ``modules_to_not_convert``
    names it (transformers and vLLM keep embeddings, norms and ``lm_head`` dense on their own)."""

    patterns: tuple[str, ...]
    reason: str
    linear: bool = False

    def match(self, module: str) -> str | None:
        """The first pattern ``module`` matches, or None."""
        dotted = f".{module}."
        return next((p for p in self.patterns if p in dotted), None)


# AutoAWQ quantizes only the linears of the decoder blocks; these are the 2-D weights outside them, by the names
# the Hugging Face model families use (embed_tokens, wte/wpe of GPT-2, word_embeddings, *norm*, lm_head), and the
# MoE routers AutoAWQ lists in its own modules_to_not_convert ("gate" for Mixtral, Qwen-MoE, DeepSeek).
DENSE_KEEP: tuple[KeepRule, ...] = (
    KeepRule(("embed", "wte", "wpe"), "embedding"),
    KeepRule(("lm_head",), "output head"),
    KeepRule(("norm",), "normalization"),
    KeepRule((".gate.", "router"), "mixture-of-experts router (AutoAWQ and vLLM keep it dense)", linear=True),
)


@dataclass(frozen=True)
class UnquantizedWeight:
    """A dense ``<module>.weight`` of a linear-looking (2-D) module that was passed through unquantized."""

    name: str                                  # the tensor, "<module>.weight"
    reason: str


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert_checkpoint`` wrote."""

    kind: SourceKind
    source: Path
    destination: Path
    group_size: int                            # as written to the config (-1 = one group)
    zero_point: bool
    quantized: tuple[str, ...]                 # module names written as gemm layers
    passed_through: tuple[str, ...]            # tensor names copied unchanged
    unquantized: tuple[UnquantizedWeight, ...] = ()    # dense input only
    modules_to_not_convert: tuple[str, ...] = ()
    side_files: tuple[str, ...] = ()           # file names copied next to the weights
    source_formats: tuple[str, ...] = ()       # AWQ input: the layouts found (sorted)


# ---------------------------------------------------------------------------------------------------------------
# Entry points

def convert_checkpoint(src, dst, *, group_size: int | None = None, zero_point: bool = True, skip: Iterable[str] = (),
                       max_shard_size=None, overwrite: bool = False, progress=None) -> ConvertResult:
    """Write ``src`` (an AWQ checkpoint in any layout, or a dense safetensors model) into ``dst`` as an AutoAWQ
    ``gemm`` checkpoint; see the module docstring for what happens to each kind.

    ``group_size``: dense input: the group size to quantize with (default 128, -1 = one group per row; it must
    be -1 or a multiple of 32, which the kernels need); AWQ input: None or the checkpoint's own value.
    ``zero_point``: asymmetric (True) or symmetric (False) quantization of dense input; for AWQ input the
    checkpoint's setting is kept, and False on an asymmetric checkpoint is refused.
    ``skip``: substrings of module names to keep dense (written as ``modules_to_not_convert``); for AWQ input
    they may not match a quantized layer and are added to the checkpoint's own list.
    ``max_shard_size`` (bytes or ``"5GB"``): shard the output above it. ``overwrite``: replace a checkpoint or
    side files already in ``dst``, else FileExistsError before anything is written.
    ``progress``: ``make_reporter`` semantics (None: only on a terminal for models of 2 GiB and more; True; False;
    a callable ``(done, total, description)``), called per shard opened, per layer converted or quantized and
    per shard written.
    Raises CheckpointError for a folder that is neither kind, ValueError for contradictory options.
    """
    src_dir, dst_dir = Path(src), Path(dst)
    for flag, value in (("zero_point", zero_point), ("overwrite", overwrite)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    skip = _check_skip(skip)
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or not (group_size == -1 or group_size > 0)):
        raise ValueError(f"{group_size=} must be -1 (one group per row) or a positive int")
    kind, config = _source_kind(src_dir)
    if dst_dir.resolve() == src_dir.resolve():
        raise ValueError(f"source and destination are the same folder ({src_dir.resolve()}); convert writes a new "
                         "checkpoint next to the old one, give another destination")
    if kind is SourceKind.AWQ:
        return _convert_awq(src_dir, dst_dir, group_size, zero_point, skip, max_shard_size, overwrite, progress)
    return _convert_dense(src_dir, dst_dir, config, DEFAULT_GROUP_SIZE if group_size is None else group_size,
                          zero_point, skip, max_shard_size, overwrite, progress)


def main(src, dst, *, group_size: int | None = None, zero_point: bool = True, skip: Iterable[str] = (),
         max_shard_size=None, overwrite: bool = False, progress=None, stream: TextIO | None = None) -> int:
    """``awq-cupy convert``: run ``convert_checkpoint`` and print a summary to ``stream`` (default: sys.stdout at
    call time). Returns 0; a checkpoint, option or file error is printed as ``error: <message>`` on stderr
    and returns 2."""
    out = sys.stdout if stream is None else stream
    try:
        result = convert_checkpoint(src, dst, group_size=group_size, zero_point=zero_point, skip=skip,
                                    max_shard_size=max_shard_size, overwrite=overwrite, progress=progress)
    except (CheckpointError, ValueError, OSError) as e:     # OSError: FileExistsError, permissions, disk full
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in summary_lines(result):
        print(line, file=out)
    return 0


def summary_lines(r: ConvertResult) -> list[str]:
    """The lines ``main`` prints for a result."""
    what = (f"AWQ checkpoint ({', '.join(r.source_formats) or 'no quantized layers'})" if r.kind is SourceKind.AWQ
            else "dense checkpoint")
    how = "rewritten as gemm" if r.kind is SourceKind.AWQ else "quantized by round-to-nearest"
    lines = [f"converted {what}: {r.source}",
             f"  quantized layers: {len(r.quantized)} ({how}; group_size {r.group_size}, "
             f"zero_point {str(r.zero_point).lower()})",
             f"  passed through: {len(r.passed_through)} tensor(s)"]
    if r.unquantized:
        lines.append(f"  left unquantized: {len(r.unquantized)} linear-looking weight(s)")
        lines += [f"    {u.name}: {u.reason}" for u in r.unquantized[:_MAX_LISTED]]
        if len(r.unquantized) > _MAX_LISTED:
            lines.append(f"    ... and {len(r.unquantized) - _MAX_LISTED} more")
    if r.modules_to_not_convert:
        shown = ", ".join(r.modules_to_not_convert[:_MAX_LISTED])
        more = f", ... ({len(r.modules_to_not_convert)} in all)" if len(r.modules_to_not_convert) > _MAX_LISTED else ""
        lines.append(f"  modules_to_not_convert: {shown}{more}")
    if r.side_files:
        lines.append(f"  side files copied: {', '.join(r.side_files)}")
    lines.append(f"wrote {r.destination}")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Source and destination checks

def _check_skip(skip) -> tuple[str, ...]:
    if isinstance(skip, str):                  # a bare string would be split into one-letter patterns
        raise TypeError(f"skip must be a list of patterns, got the string {skip!r}")
    patterns = tuple(skip)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"skip patterns must be strings, got {patterns!r}")
    if any(not p for p in patterns):
        raise ValueError("an empty skip pattern would match every module")
    return tuple(dict.fromkeys(patterns))


def _source_kind(d: Path) -> tuple[SourceKind, dict]:
    """(AWQ or dense, config.json as read or {}), from the config files alone (the weights are checked by
    whoever opens them)."""
    if not d.exists():
        raise CheckpointError(f"{d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory; convert reads a model folder (config.json and safetensors "
                              "weights)")
    config_path, config = d / CONFIG_FILE, {}
    if config_path.is_file():
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path}: must hold a JSON object")
        if config.get("quantization_config") is not None:
            try:                               # refuse other methods (gptq, fp8, ...) here, with the rule
                QuantConfig.from_dict(config["quantization_config"], str(config_path))
            except CheckpointError as e:
                raise CheckpointError(f"{e}. convert takes AWQ 4-bit checkpoints and dense (unquantized) models, "
                                      "whose config.json has no quantization_config") from e
            return SourceKind.AWQ, config
    if any((d / name).is_file() for name in OLD_CONFIG_FILES):
        return SourceKind.AWQ, config
    if config_path.is_file():
        return SourceKind.DENSE, config
    has_weights = any(d.glob("*.safetensors"))
    raise CheckpointError(
        f"{d}: not a model folder convert can read: {'it holds safetensors weights but' if has_weights else 'it has'}"
        f" no {CONFIG_FILE}. A dense model needs {CONFIG_FILE} (without quantization_config) and safetensors "
        f"weights; an AWQ checkpoint needs {CONFIG_FILE} with quantization_config (or {OLD_CONFIG_FILES[0]})")


def _side_files(d: Path) -> list[Path]:
    """Top-level files of the source folder that the new checkpoint needs next to its weights."""
    return sorted(p for p in d.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in _REPLACED_FILES
                  and not p.name.endswith(".index.json") and not p.name.lower().endswith(_WEIGHT_SUFFIXES))


def _check_destination(dst: Path, side: list[Path], overwrite: bool) -> None:
    """Refuse, before anything is written, to replace a checkpoint or a different side file in ``dst``."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{dst} exists and is not a directory")
    if overwrite or not dst.is_dir():
        return
    held = [p.name for p in stale_files(dst)]
    held += [p.name for p in side if (dst / p.name).exists() and not _same_file(p, dst / p.name)]
    if held:
        raise FileExistsError(f"{dst} already holds {', '.join(held)}; pass overwrite=True (--overwrite) to "
                              "replace them")


def _same_file(a: Path, b: Path) -> bool:
    return b.is_file() and filecmp.cmp(a, b, shallow=False)


def _copy_side_files(side: list[Path], dst: Path) -> tuple[str, ...]:
    for p in side:
        if not _same_file(p, dst / p.name):
            shutil.copy2(p, dst / p.name)     # follows symlinks: Hugging Face cache snapshots link to blobs
    return tuple(p.name for p in side)


def _reporter(progress, nbytes: int) -> Reporter | None:
    return make_reporter(progress, nbytes >= AUTO_PROGRESS_BYTES)


# ---------------------------------------------------------------------------------------------------------------
# AWQ input

class _ReportOnRead(Mapping):
    """A layer's tensors that call ``on_read`` the first time one is read: save_checkpoint reads them when it
    converts the layer, which is the moment to report it."""

    def __init__(self, tensors: Mapping, on_read: Callable[[], None]):
        self._tensors, self._on_read = tensors, on_read

    def __getitem__(self, key):
        if self._on_read is not None:
            on_read, self._on_read = self._on_read, None
            on_read()
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _convert_awq(src: Path, dst: Path, group_size, zero_point, skip, max_shard_size, overwrite,
                 progress) -> ConvertResult:
    # uint16 bit patterns for BF16 whether or not ml_dtypes is installed; the declared dtype keeps them BF16
    report = _reporter(progress, sum(p.stat().st_size for p in src.glob("*.safetensors")))
    with load_checkpoint(src, progress=report or False, bf16="uint16") as ckpt:
        return _write_awq(ckpt, src, dst, group_size, zero_point, skip, max_shard_size, overwrite, report)


def _write_awq(ckpt: Checkpoint, src: Path, dst: Path, group_size, zero_point, skip, max_shard_size, overwrite,
               report: Reporter | None) -> ConvertResult:
    qc = ckpt.quant_config
    if group_size is not None and group_size != qc.group_size:
        raise ValueError(
            f"{src}: group_size={group_size} differs from the checkpoint's group_size={qc.group_size} "
            f"({qc.source}); regrouping quantized weights is not lossless, so convert keeps the checkpoint's "
            "(leave the group size out)")
    if not zero_point and qc.zero_point:
        raise ValueError(
            f"{src}: zero_point=False asks for symmetric weights, but the checkpoint is asymmetric (zero_point "
            f"true in {qc.source}); re-quantizing is not lossless, so convert keeps the checkpoint's")
    for p in skip:
        hit = next((name for name in ckpt.layers if p in name), None)
        if hit is not None:
            raise ValueError(f"skip pattern {p!r} matches the quantized layer {hit!r} of {src}; convert cannot "
                             "turn an AWQ layer back into a dense one")
    side = _side_files(src)
    _check_destination(dst, side, overwrite)

    names = list(ckpt.layers)
    count = [0]

    def converted(name: str) -> None:
        count[0] += 1
        if report:
            report(count[0], len(names), f"converting {name}")

    layers = {name: dataclasses.replace(layer, tensors=_ReportOnRead(layer.tensors, lambda n=name: converted(n)))
              for name, layer in ckpt.layers.items()}
    skip_all = tuple(dict.fromkeys(qc.modules_to_not_convert + skip))
    save_checkpoint(dst, layers, ckpt.tensors, group_size=qc.group_size, config=ckpt.config,
                    zero_point=qc.zero_point, modules_to_not_convert=skip_all, max_shard_size=max_shard_size,
                    overwrite=overwrite, progress=report or False)
    return ConvertResult(
        kind=SourceKind.AWQ, source=src, destination=dst, group_size=qc.group_size, zero_point=qc.zero_point,
        quantized=tuple(names), passed_through=tuple(ckpt.tensors), modules_to_not_convert=skip_all,
        side_files=_copy_side_files(side, dst),
        source_formats=tuple(sorted({layer.format for layer in ckpt.layers.values()})))


# ---------------------------------------------------------------------------------------------------------------
# Dense input

def _open_dense(d: Path) -> dict[str, SafetensorsFile]:
    """name -> the file holding it, for a dense model's safetensors (bf16 as uint16 bit patterns)."""
    if not any(d.glob("*.safetensors")) and any(d.glob("*.bin")):
        raise CheckpointError(f"{d}: holds PyTorch .bin weights only; convert reads safetensors (re-save the model "
                              "with safe_serialization=True, or convert it with the safetensors tools)")
    files, _, _ = weight_files(d)
    where: dict[str, SafetensorsFile] = {}
    for sf in (open_weight_file(f, "uint16") for f in files):
        for name in sf.keys():
            if name in where:
                raise CheckpointError(f"tensor {name!r} appears in both {where[name].path} and {sf.path}")
            where[name] = sf
    return where


def _why_not(module: str, info, group_size: int, skip: tuple[str, ...]) -> tuple[str, bool] | None:
    """(reason, is an nn.Linear loaders would quantize) for a 2-D ``<module>.weight`` left dense; None to
    quantize it."""
    for rule in DENSE_KEEP:
        pattern = rule.match(module)
        if pattern is not None:
            return f"{rule.reason} (name matches {pattern!r})", rule.linear
    pattern = next((p for p in skip if p in module), None)
    if pattern is not None:
        return f"matches skip pattern {pattern!r}", False          # the pattern itself goes to the config
    if info.dtype not in _QUANTIZABLE_CODES:
        return f"dtype {info.dtype} is not one of {'/'.join(_QUANTIZABLE_CODES)}", True
    N, K = info.shape
    if N % 8:
        return f"out_features N={N} is not a multiple of 8 (every AWQ layout needs it)", True
    if K % 8:
        return f"in_features K={K} is not a multiple of 8", True
    if group_size != -1 and K % group_size:
        return f"in_features K={K} is not a multiple of group_size {group_size}", True
    return None                                # the kernels run G: checked for every layer at once (_convert_dense)


def _quantizer(sf: SafetensorsFile, name: str, G: int, zero_point: bool, done: Callable[[], None]):
    """``PendingLayer.produce``: read and quantize one weight when save_checkpoint writes it."""
    def produce() -> QuantizedTensors:
        w = sf.get(name)                       # a memory map: read from disk now, not when the folder was opened
        if sf.dtype_code(name) == "BF16":      # bit patterns -> float32 exactly; quantize treats it like bf16
            w = formats.bf16_bits_to_float32(w)
        try:
            qt = quantize(w, G, zero_point)
        except ValueError as e:
            raise ValueError(f"{sf.path}: cannot quantize {name!r}: {e}") from e
        done()
        return qt

    return produce


def _convert_dense(src: Path, dst: Path, config: dict, group_size: int, zero_point, skip, max_shard_size, overwrite,
                   progress) -> ConvertResult:
    # weight.check_group_size's rule (G % 32 == 0 or G == K) for every layer at once: a G that only fits where
    # K happens to equal it is a typo rather than a plan, and one group per row is what -1 asks for
    if group_size != -1 and group_size % 32:
        raise ValueError(f"group_size={group_size} is not supported by the awq_cupy kernels: use a multiple of 32 "
                         "(32, 64, 128, ...) or -1 (one group per row)")
    where = _open_dense(src)
    packed = [n for n in where if n.endswith(".qweight") or n == "qweight"]
    if packed:
        raise CheckpointError(f"{src}: holds AWQ tensors ({packed[0]!r}) but {src / CONFIG_FILE} has no "
                              "quantization_config; add the config the checkpoint was written with")

    plan: dict[str, tuple[SafetensorsFile, str, int, int]] = {}     # module -> (file, weight name, K, N)
    unquantized: list[tuple[str, str, str, bool]] = []              # (module, weight name, reason, linear)
    for name, sf in where.items():
        info = sf.info(name)
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue                           # biases, norms' vectors, convolutions: not linear layers
        module = name[: -len(".weight")]
        why = _why_not(module, info, group_size, skip)
        if why is None:
            N, K = info.shape
            plan[module] = (sf, name, K, N)
        else:
            unquantized.append((module, name, *why))
    if not plan:
        shown = "; ".join(f"{n}: {r}" for _, n, r, _ in unquantized[:3]) or "no 2-D <module>.weight tensors"
        raise ValueError(f"{src}: no weight can be quantized ({shown})")

    # Linears left dense must be named in modules_to_not_convert, or loaders would expect a qweight for them. A
    # name that is part of a quantized module's name cannot be listed (it is a substring pattern).
    not_convert = list(skip)
    for module, _, _, linear in unquantized:
        if linear and not any(p in module for p in not_convert) and not any(module in m for m in plan):
            not_convert.append(module)

    report = _reporter(progress, sum(sf.info(n).nbytes for n, sf in where.items()))
    count = [0]

    def quantized(module: str) -> None:
        count[0] += 1
        if report:
            report(count[0], len(plan), f"quantized {module}")

    G = group_size
    layers = {module: PendingLayer(in_features=K, out_features=N, group_size=K if G == -1 else G,
                                   produce=_quantizer(sf, name, K if G == -1 else G, zero_point,
                                                      lambda m=module: quantized(m)))
              for module, (sf, name, K, N) in plan.items()}
    weights = {name for _, name, _, _ in plan.values()}
    biases = {f"{m}.bias" for m in plan} & where.keys()     # save_checkpoint writes these with their layers
    others = LazyTensors({n: sf for n, sf in where.items() if n not in weights})
    side = _side_files(src)
    _check_destination(dst, side, overwrite)
    save_checkpoint(dst, layers, others, group_size=G, config=config, zero_point=zero_point,
                    modules_to_not_convert=not_convert, max_shard_size=max_shard_size, overwrite=overwrite,
                    progress=report or False)
    return ConvertResult(
        kind=SourceKind.DENSE, source=src, destination=dst, group_size=G, zero_point=zero_point,
        quantized=tuple(plan), passed_through=tuple(n for n in others if n not in biases),
        unquantized=tuple(UnquantizedWeight(name, reason) for _, name, reason, _ in unquantized),
        modules_to_not_convert=tuple(not_convert), side_files=_copy_side_files(side, dst))
