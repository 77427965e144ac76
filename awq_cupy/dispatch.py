"""Which kernel ``matmul`` runs for a given M, per GPU architecture: data, measured on the GPU named per row.

``gemv_max_m``: largest M for the swapped-operand tensor-core GEMV (kernels_cu/gemv_tc.cu; at most 16).
``gemv_wide_max_m``: 0, or the largest M (17..32) up to which the GEMV's three- and four-token-block variants run
beyond ``gemv_max_m`` on the layer shapes ``plans.gemv_wide_takes`` gives them (compute capability 9.0 only).
``cublas_min_m``: smallest M at which dequantize + cuBLAS (fp16 only) beats the fused GEMM (with a cost model: the
smallest M at which it may, the model deciding per layer shape); it is never used while the current stream is
capturing a CUDA graph (CuPy cannot capture cuBLAS), nor with ``batch_invariant``.
``wgmma_min_m``: on GPUs that have the Hopper wgmma GEMM (kernels_cu/gemm_wg.cu, compute capability 9.0), the
smallest M at which the fused GEMM is that kernel rather than the mma.sync one (kernels_cu/gemm_tc.cu); None:
never. ``batch_invariant`` matmul runs one GEMM kernel for every M: the wgmma one unless this is None.
``gemv_slot``: the GEMV's relative time per 16-column block slot of its 2-, 3- and 4-block variants, per dtype and
token blocks, from which ``plans.gemv_tiles_for`` picks the variant per layer shape; None: the H200's
(``H200_GEMV_SLOT``). ``gemv_kd2_slot``: the same for its pairs with two 64-k blocks per unit, from which
``plans.gemv_kdepth_for`` decides whether they replace that pick; None: the H200's (``H200_GEMV_KD2_SLOT``).

The built-in rows below were measured with ``python -m awq_cupy bench`` (docs/design.md §Crossovers).
``python -m awq_cupy tune`` measures them on the GPU at hand and writes a JSON table; ``for_arch`` reads that file
when it exists: ``$AWQ_CUPY_DISPATCH`` if set (``builtin`` ignores every file), else ``<cache dir>/dispatch.json``
(the compile cache directory, ``$AWQ_CUPY_CACHE_DIR`` or ``~/.cache/awq_cupy``). Archs without a row use
``default``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import settings

GEMV_LIMIT = 16      # the GEMV's largest M for every layer shape (two token blocks of 8)
GEMV_WIDE_LIMIT = 32  # and per layer shape (plans.gemv_wide_takes: three and four token blocks, sm_90)

# The GEMV's blocks per warp unit (plans.gemv_tiles_for) come from a time per 16-column block slot of its 2-, 3- and
# 4-block variants, per activation dtype and token blocks (1: M <= 8, 2: M = 9..16, 3 and 4: up to 24 and 32),
# relative to the 4-block one (at four token blocks the 3-block one: there are no fours).
# H200, one and two token blocks: `tune.fit_gemv_slot` over sweeps of the Mistral-7B and Llama-2-70B layers (2, 3,
# 4, 5, 14 and 28 blocks per CTA; M = 1 and 8, and M = 16 where the pairs decode scaled weights at 16 warps). With
# the two-k-block pairs' times below they pick the measured fastest variant on every swept layer. A row without its
# own ``gemv_slot`` uses these; `python -m awq_cupy tune` fits the GPU's own (one and two token blocks).
# Three and four token blocks: set by hand over the same layers at M = 17..32; on the layer rows
# plans.gemv_wide_takes gives the GEMV they pick the fastest variant on all but three, none of those more than 3%
# off (docs/design.md §Crossovers).
GEMV_SLOT_TILES = (2, 3, 4)
H200_GEMV_SLOT = {"float16": {1: {4: 1.0, 3: 1.0, 2: 1.18}, 2: {4: 1.0, 3: 1.04, 2: 1.15},
                              3: {4: 1.0, 3: 1.1, 2: 1.2}, 4: {3: 1.0, 2: 1.2}},
                  "bfloat16": {1: {4: 1.0, 3: 1.0, 2: 1.16}, 2: {4: 1.0, 3: 1.06, 2: 1.23},
                               3: {4: 1.0, 3: 1.05, 2: 1.2}, 4: {3: 1.0, 2: 1.2}}}

# The pair variants with two 64-k blocks per unit (kdepth 2; groups of whole 64-k blocks): their time per block slot
# on the same scale, per dtype and token blocks (``plans.gemv_kdepth_for`` takes them where they cost less than the
# tiles' choice). H200: `tune.fit_gemv_kd2` over the same sweeps with the slot times above. They take Mistral-7B's o
# and down up to M = 8 (bf16: gate_up too), where they tie with the plain pairs at one token or run a few percent
# faster. From 9 tokens the plain pairs, which decode scaled weights at 16 warps, are faster than them on every
# measured layer (docs/design.md §GEMV (gemv_tc)).
H200_GEMV_KD2_SLOT = {"float16": {1: 1.16, 2: 1.16}, "bfloat16": {1: 1.07, 2: 1.28}}


def default_gemv_slot(dtype: str, token_blocks: int) -> dict[int, float]:
    """The H200's GEMV slot times for ``dtype`` (fp16's for another name) and ``token_blocks``."""
    return H200_GEMV_SLOT.get(dtype, H200_GEMV_SLOT["float16"])[token_blocks]


def _positive(t) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0


def _per_dtype_and_blocks(v, name: str, what: str, check, blocks: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    """A {dtype: {token blocks: value}} field with integer keys (a JSON file has strings), token blocks among
    ``blocks``, each value passed through ``check(dtype, token blocks, value)`` (which returns it parsed or raises
    ValueError)."""
    if not isinstance(v, dict) or not v:
        raise ValueError(f"dispatch {name}={v!r} must be a non-empty {{dtype: {{token blocks: {what}}}}}")
    out = {}
    for dt, per_nb in v.items():
        if dt not in ("float16", "bfloat16") or not isinstance(per_nb, dict) or not per_nb:
            raise ValueError(f"dispatch {name}: {dt!r}: a dtype (float16, bfloat16) mapping token blocks "
                             f"{blocks} to {what}")
        out[dt] = {}
        for nb, val in per_nb.items():
            try:
                nbi = int(nb)
            except (TypeError, ValueError):
                nbi = None
            if nbi not in blocks:
                raise ValueError(f"dispatch {name}[{dt!r}]: {nb!r}: token blocks among {blocks}")
            out[dt][nbi] = check(dt, nb, val)
    return out


def _gemv_slot(v) -> dict:
    """``gemv_slot`` checked: {dtype: {token blocks: {tiles: time}}}."""
    def tiles(dt, nb, per_tw):
        try:
            tws = {int(tw): t for tw, t in per_tw.items()}
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"dispatch gemv_slot[{dt!r}]: {nb!r}: {per_tw!r} is not {{tiles: time}}") from None
        allowed = GEMV_SLOT_TILES if int(nb) < 4 else (2, 3)     # no fours at four token blocks
        if not tws or not set(tws) <= set(allowed):
            raise ValueError(f"dispatch gemv_slot[{dt!r}][{nb!r}]: tiles among {allowed}, got {per_tw!r}")
        for tw, t in tws.items():
            if not _positive(t):
                raise ValueError(f"dispatch gemv_slot[{dt!r}][{nb!r}][{tw}]={t!r} must be a positive number")
        return tws

    return _per_dtype_and_blocks(v, "gemv_slot", "{tiles: time}", tiles)


def _gemv_kd2_slot(v) -> dict:
    """``gemv_kd2_slot`` checked: {dtype: {token blocks: time}}."""
    def time(dt, nb, t):
        if not _positive(t):
            raise ValueError(f"dispatch gemv_kd2_slot[{dt!r}][{nb!r}]={t!r} must be a positive number")
        return t

    return _per_dtype_and_blocks(v, "gemv_kd2_slot", "a time", time, (1, 2))   # pairs with KD 2: up to 16 rows


@dataclass(frozen=True)
class Dispatch:
    gemv_max_m: int
    cublas_min_m: int
    wgmma_min_m: int | None = None
    # Per layer shape from cublas_min_m on (None: dequantize + cuBLAS for every shape): the fused GEMM's modelled
    # time (64-k units of its 256-token tile, fused_unit_us each with one CTA per SM, in waves over the SMs, split-K
    # as planned) against dequantize (K x N x 2.5 bytes at dequant_tbps) + cuBLAS (2 M K N at cublas_tflops).
    fused_unit_us: float | None = None
    dequant_tbps: float | None = None
    cublas_tflops: float | None = None
    # GEMV slot times ({dtype: {token blocks: {tiles: time}}}, see H200_GEMV_SLOT); None: the H200's.
    gemv_slot: dict | None = field(default=None, hash=False)
    # Slot time of the GEMV pairs with two 64-k blocks per unit ({dtype: {token blocks: time}}, on gemv_slot's
    # scale, see H200_GEMV_KD2_SLOT); None: the H200's.
    gemv_kd2_slot: dict | None = field(default=None, hash=False)
    # 0, or the largest M of the GEMV's three- and four-token-block variants on the shapes plans.gemv_wide_takes
    # gives them (beyond gemv_max_m, at most GEMV_WIDE_LIMIT).
    gemv_wide_max_m: int = 0

    def __post_init__(self):
        if self.gemv_slot is not None:
            object.__setattr__(self, "gemv_slot", _gemv_slot(self.gemv_slot))
        if self.gemv_kd2_slot is not None:
            object.__setattr__(self, "gemv_kd2_slot", _gemv_kd2_slot(self.gemv_kd2_slot))
        for name in ("gemv_max_m", "cublas_min_m"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"dispatch {name}={v!r} must be a non-negative integer")
        w = self.wgmma_min_m
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"dispatch wgmma_min_m={w!r} must be a positive integer or None")
        if self.gemv_max_m > GEMV_LIMIT:
            raise ValueError(f"dispatch gemv_max_m={self.gemv_max_m} exceeds the GEMV's limit of {GEMV_LIMIT}")
        wide = self.gemv_wide_max_m
        if not isinstance(wide, int) or isinstance(wide, bool) or not (
                wide == 0 or GEMV_LIMIT < wide <= min(GEMV_WIDE_LIMIT, self.cublas_min_m - 1)):
            raise ValueError(f"dispatch gemv_wide_max_m={wide!r} must be 0 or {GEMV_LIMIT + 1} to {GEMV_WIDE_LIMIT} "
                             f"(and below cublas_min_m={self.cublas_min_m})")
        if self.cublas_min_m <= self.gemv_max_m:
            raise ValueError(f"dispatch cublas_min_m={self.cublas_min_m} must exceed gemv_max_m={self.gemv_max_m}")
        model = (self.fused_unit_us, self.dequant_tbps, self.cublas_tflops)
        if any(v is not None for v in model):
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in model):
                raise ValueError(f"dispatch cost model fused_unit_us={self.fused_unit_us}, dequant_tbps="
                                 f"{self.dequant_tbps}, cublas_tflops={self.cublas_tflops}: all three positive "
                                 "numbers, or none")
            if self.cublas_min_m < 256 or self.wgmma_min_m is None:
                raise ValueError(f"dispatch cost model needs the wgmma GEMM and cublas_min_m >= 256 (its 256-token "
                                 f"tile), got cublas_min_m={self.cublas_min_m}, wgmma_min_m={self.wgmma_min_m}")

    @property
    def has_cost_model(self) -> bool:
        return self.fused_unit_us is not None

    def gemv_slot_for(self, dtype: str, token_blocks: int) -> dict[int, float]:
        """{tiles: relative time per block slot} of the GEMV for ``dtype`` and ``token_blocks``: this row's where it
        has them, else the H200's."""
        own = (self.gemv_slot or {}).get(dtype, {}).get(token_blocks)
        return own if own else default_gemv_slot(dtype, token_blocks)

    def gemv_kd2_for(self, dtype: str, token_blocks: int) -> float | None:
        """Slot time of the two-64-k-block pairs for ``dtype`` and ``token_blocks``: this row's where it has one,
        else the H200's; None where neither has one (then they are not used)."""
        own = (self.gemv_kd2_slot or {}).get(dtype, {}).get(token_blocks)
        return own if own else H200_GEMV_KD2_SLOT.get(dtype, {}).get(token_blocks)


TABLE: dict[str, Dispatch] = {
    # H200 (sm_90), from `python -m awq_cupy tune` over the Mistral-7B layers (docs/design.md §Crossovers). The
    # GEMV up to 16 rows, where its 16-token variant beats every GEMM, and to 32 on the shapes plans.gemv_wide_takes
    # gives its three- and four-token-block variants. The wgmma GEMM from 17: it beats the mma.sync one from the
    # 32-token tile on; the mma.sync one leads only at M <= 16, which the GEMV takes. From M = 768 (the fused GEMM
    # wins on every layer up to 512) the cost model picks per layer shape; its three constants are fitted to the
    # tune's per-layer times at M >= 768. dequant_tbps sits below the dequantize kernel's own bandwidth (~3.1 TB/s)
    # because it also stands in for that path's fixed costs, which the small layers feel. fused_unit_us is the
    # wgmma GEMM's unit time with the x tile pass (plans._TMA_UNIT_SCALE scales it where x comes by tensor map):
    # over both models' layers at M = 768..4096 the fused GEMM beat dequantize + cuBLAS in all 56 cells by 2.5-51%
    # (docs/design.md §Crossovers), which 0.76 picks right; 0.78 sent Mistral-7B gate_up at 4096 and o at 1536 and
    # 2560 to cuBLAS, 2.5-9% slower there.
    "90": Dispatch(gemv_max_m=16, cublas_min_m=768, wgmma_min_m=17, fused_unit_us=0.76, dequant_tbps=2.6,
                   cublas_tflops=760.0, gemv_wide_max_m=32),
    "default": Dispatch(gemv_max_m=12, cublas_min_m=256),
}


MODEL_FIELDS = ("fused_unit_us", "dequant_tbps", "cublas_tflops")


def builtin_gemv_wide(arch_key: str, cublas_min_m) -> int:
    """The built-in row's ``gemv_wide_max_m`` for a row with this ``cublas_min_m``: 0 where that leaves no room."""
    wide = TABLE.get(arch_key, TABLE["default"]).gemv_wide_max_m
    return wide if cublas_min_m > wide else 0


def builtin_model(arch_key: str, cublas_min_m, wgmma_min_m) -> dict:
    """The built-in row's cost model fields for a row with these values (empty when they rule it out)."""
    builtin = TABLE.get(arch_key, TABLE["default"])
    if not builtin.has_cost_model or wgmma_min_m is None or not isinstance(cublas_min_m, int) or cublas_min_m < 256:
        return {}
    return {name: getattr(builtin, name) for name in MODEL_FIELDS}


def table_path() -> Path | None:
    """The tuned table ``for_arch`` reads, or None (``AWQ_CUPY_DISPATCH=builtin``; the variable as
    ``settings.current()`` read it)."""
    env = settings.current().dispatch
    if env == "builtin":
        return None
    if env:
        return Path(env)
    from .jit import cache_dir

    return cache_dir() / "dispatch.json"


_loaded: dict = {}     # AWQ_CUPY_DISPATCH value -> the tuned rows in force (read once per process)
settings.on_reload(_loaded.clear)


def load_table(path: Path) -> dict[str, Dispatch]:
    """Rows of a table written by ``python -m awq_cupy tune``; ValueError naming the file when malformed. A row
    without ``wgmma_min_m`` or ``gemv_wide_max_m`` (written before they existed) takes the built-in row's (the
    latter only where the row's cublas_min_m leaves room for it, else 0); one without the cost model's
    fields takes the built-in row's model where that is consistent with the row (cublas_min_m >= 256 and a
    wgmma GEMM), else none."""
    try:
        data = json.loads(Path(path).read_text())
        rows = data["table"]
        out = {}
        for k, v in rows.items():
            v = dict(v)
            builtin = TABLE.get(str(k), TABLE["default"])
            v.setdefault("wgmma_min_m", builtin.wgmma_min_m)
            v.setdefault("gemv_wide_max_m", builtin_gemv_wide(str(k), v.get("cublas_min_m", 0)))
            if not any(name in v for name in MODEL_FIELDS):
                v.update(builtin_model(str(k), v["cublas_min_m"], v["wgmma_min_m"]))
            out[str(k)] = Dispatch(**v)
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"dispatch table {path} is not a valid `python -m awq_cupy tune` file: {e}") from None


def reload() -> None:
    """Forget the tuned table read so far, and every launch plan made from it: the next ``for_arch`` reads the
    file again (``write_table`` does this; call it after editing the file by other means in a running process).
    The same as ``settings.reload()``, which also reads the environment again."""
    settings.reload()


def for_arch(arch_key: str) -> Dispatch:
    """The row for ``arch_key``: the tuned table's (read at the first call, not on every ``matmul``), else the
    built-in one."""
    key = settings.current().dispatch
    tuned = _loaded.get(key)
    if tuned is None:
        path = table_path()
        tuned = load_table(path) if path is not None and path.is_file() else {}
        _loaded[key] = tuned
    row = tuned.get(arch_key)
    return row if row is not None else TABLE.get(arch_key, TABLE["default"])


def write_table(path: Path, rows: dict[str, Dispatch], measured: dict) -> None:
    """Write (merge into) a tuned table: one row per arch key, with the measurements that chose it."""
    path = Path(path)
    old = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
    table = dict(old.get("table", {}))
    table.update({k: asdict(v) for k, v in rows.items()})
    meas = dict(old.get("measured", {}))
    meas.update(measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"table": table, "measured": meas}, indent=1))
    tmp.replace(path)
    reload()
