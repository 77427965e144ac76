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

The built-in rows below were measured with ``python -m awq_cupy bench`` (bench/NOTES.md). ``python -m awq_cupy
tune`` measures them on the GPU at hand and writes a JSON table; ``for_arch`` reads that file when it exists:
``$AWQ_CUPY_DISPATCH`` if set (``builtin`` ignores every file), else ``<cache dir>/dispatch.json`` (the compile
cache directory, ``$AWQ_CUPY_CACHE_DIR`` or ``~/.cache/awq_cupy``). Archs without a row use ``default``.
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
# H200: `tune.fit_gemv_slot` at one token block over bench/results/h200_gemv_sweep_v29.txt for fp16 (the Mistral-7B
# and Llama-2-70B layers, 2, 3, 4, 5, 14 and 28 blocks per CTA; M = 1) and h200_gemv_sweep_v37_bf16_m1.txt for bf16
# (the same layers, M = 1 and 8), and at two token blocks over h200_gemv_sweep_v36_m16.txt (M = 16, the same layers;
# v36: the pairs there decode scaled weights at 16 warps). With the two-k-block pairs' times below, each picks the
# measured fastest variant on every swept layer (bench/NOTES.md v29, v36, v37). A row without its own ``gemv_slot``
# uses these; `python -m awq_cupy tune` fits the GPU's own (one and two token blocks).
# Three and four token blocks: set by hand over the v40 sweep (bench/results/h200_gemv_wide_sweep_v40.txt:
# Mistral-7B M = 17..32 fp16, 17, 24, 32 bf16; Llama-2-70B M = 17, 24, 32 fp16 and bf16). They pick the fastest
# variant on every layer row that plans.gemv_wide_takes gives the GEMV but three: two ties (0.05 us) and bf16
# Mistral-7B o at M = 24 (8.86 against 8.60 us).
GEMV_SLOT_TILES = (2, 3, 4)
H200_GEMV_SLOT = {"float16": {1: {4: 1.0, 3: 1.0, 2: 1.18}, 2: {4: 1.0, 3: 1.04, 2: 1.15},
                              3: {4: 1.0, 3: 1.1, 2: 1.2}, 4: {3: 1.0, 2: 1.2}},
                  "bfloat16": {1: {4: 1.0, 3: 1.0, 2: 1.16}, 2: {4: 1.0, 3: 1.06, 2: 1.23},
                               3: {4: 1.0, 3: 1.05, 2: 1.2}, 4: {3: 1.0, 2: 1.2}}}

# The pair variants with two 64-k blocks per unit (kdepth 2; groups of whole 64-k blocks): their time per block slot
# on the same scale, per dtype and token blocks (``plans.gemv_kdepth_for`` takes them where they cost less than the
# tiles' choice). H200: `tune.fit_gemv_kd2` over the same sweeps with the slot times above. fp16: they run Mistral-7B's
# o and down up to M = 8 (a tie with pairs at M = 1, faster at 8: o 5.59 -> 5.51, down 12.60 -> 12.26 us,
# h200_gemv_ab_kd2_plan_v29.txt); bf16 (v37, two sweeps agreeing) o, gate_up and down up to M = 8 (o a tie, down
# 11.7 -> 11.5 us at M = 1 and 12.4 -> 12.0 at 8, gate_up 0-0.1 us). From 9 tokens the plain pairs, scaled at 16
# warps since v36, are faster than them on every measured layer.
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
    # H200 (sm_90), 2026-11-30, `python -m awq_cupy tune` over the Mistral-7B layers (bench/results/
    # dispatch_h200.json, NOTES v11): the GEMV beats the fused GEMM up to M = 12 (92.6 vs 95.0 us), the GEMM with
    # cost-model split-K wins from M = 16 (96.0 vs 101.5 us); the GEMM beats dequantize + cuBLAS at M = 128
    # (265 vs 357 us) and loses at M = 256 (506 vs 357 us). After v12 (NOTES v12): `tune` kept 12 and 256 (M = 12
    # GEMV 91.6 vs GEMM 94.1 us; M = 256 wgmma GEMM 393 vs 357 us); the mma.sync GEMM beats the wgmma one up to
    # M = 32 (104.0 vs 108.6 us) and loses from M = 48 (145.4 vs 124.7 us).
    # v13 (NOTES): the wgmma GEMM with x by bulk copies beats dequantize + cuBLAS at M = 256 (244.6 vs 357 us) and
    # is level with it at M = 1024 (761 vs 743 us), so dequantize + cuBLAS runs from M = 1024.
    # v14 (NOTES): `tune` on the v13/v14 kernels (bench/results/dispatch_h200.json): dequantize + cuBLAS beats the
    # fused GEMM from M = 768 (626.8 vs 693.9 us; M = 512: 485.5 vs 440.3); the GEMV and the GEMM tie at M = 12
    # (90.0 vs 89.4 us, 92.6 vs 95.0 in the previous tune): 12 kept. With one block per warp and 6 units in
    # registers the wgmma GEMM beats the mma.sync one from the 32-token tile on (bench/gemm_sweep.py: M = 20
    # 97.2 vs 102.3 us, M = 32 98.6 vs 103.9), not at M = 16 (95.4 vs 88.8): wgmma from M = 17.
    # v16 (NOTES): x^T in the layout's k order, one 16-byte load per 32-k half, took the GEMV's 16-token variant
    # off its L1 limit. `tune` (bench/results/dispatch_h200_v16.json, h200_tune_v16.txt): GEMV 62.7 / 63.6 us
    # against the best GEMM's 81.0 / 81.2 at M = 12 / 16: GEMV up to 16. Its other two values are kept: wgmma from
    # 17 (it measured 24 because the mma.sync GEMM is 0.5 us ahead at M = 16, now a GEMV size; at M = 20 wgmma
    # leads 86.3 vs 105.0), dequantize + cuBLAS from 768 (628.3 vs 678.5 us; it measured 1536 because M = 1024 is
    # a tie, 761.0 vs 759.1).
    # v18 (NOTES): from M = 512 the choice is per layer shape, by a cost model fitted to the v16 tune
    # (bench/results/h200_tune_v16.txt: the fused GEMM's 256-token unit 0.86-0.92 us, dequantize ~3.1 TB/s,
    # cuBLAS fp16 700-790 TFLOP/s at M >= 512): at M = 1024 it keeps qkv (192 tiles: 1.45 waves) on cuBLAS and
    # runs o, gate_up and down fused (one wave of 128 tiles, 6.8 waves, one wave).
    # v20 (NOTES): weights in batches made the wgmma GEMM 6-12% faster; `tune` on it (bench/results/
    # h200_tune_v20.txt, dispatch_h200_v20.json): the fused GEMM wins on every layer up to M = 512 (qkv 49.7 vs
    # 56.6 us, o 38.5 vs 42.2), dequantize + cuBLAS first wins at M = 768 (qkv 72.7 vs 101.0): the model from 768.
    # Refitted to that tune's per-layer times at M >= 768: 0.78 us per unit, 2.6 TB/s, 760 TFLOP/s pick the
    # faster path wherever the two differ by more than 4%; it misses qkv at M = 2048 (cuBLAS 153.4 vs 159.6 us).
    # (2.6 TB/s is below the dequantize kernel's own ~3.1: it stands in for that path's fixed costs, which the small
    # layers feel; 0.74 us / 3.1 TB/s fits the tune as well but sends every layer at M = 4096 to the fused GEMM,
    # which the measured 0.78-0.84 us per unit there would make ~4% slower than dequantize + cuBLAS.)
    # v41 (NOTES): the GEMV's three- and four-token-block variants beat the wgmma GEMM at 17..32 rows on the layers
    # plans.gemv_wide_takes gives them (bench/results/h200_gemv_wide_sweep_v40.txt): gemv_wide_max_m 32.
    "90": Dispatch(gemv_max_m=16, cublas_min_m=768, wgmma_min_m=17, fused_unit_us=0.78, dequant_tbps=2.6,
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
