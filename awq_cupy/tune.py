"""``python -m awq_cupy tune``: measure which kernel is fastest at each M on this GPU and write the dispatch table.

For the chosen layers and M values it times, with the benchmark's method (awq_cupy/bench.py): the GEMV
(M <= 16), the fused tensor-core GEMM (on compute capability 9.0 both its kernels: mma.sync and wgmma) and
dequantize + cuBLAS (fp16), each summed over the layers. Then ``wgmma_min_m`` = the smallest measured M from
which the wgmma GEMM beats the mma.sync one at every larger measured M (None when it never does or the GPU has
no wgmma kernel), the GEMM's time at each M being that of the kernel this picks; ``gemv_max_m`` = the largest
measured M up to which the GEMV beats the GEMM at every measured M; ``cublas_min_m`` = the smallest measured M
from which dequantize + cuBLAS beats the GEMM at every larger measured M (one past the largest M when it never
does); where the built-in row has a cost model that picks the path per layer shape (sm_90), the smallest M from
256 on at which dequantize + cuBLAS wins on some measured layer, the model keeping its built-in constants. The
row goes to ``awq_cupy.dispatch.table_path()`` (or ``--out``) under this GPU's arch key and is used
by ``matmul`` from then on.

It also times the GEMV's 2-, 3- and 4-block variants and its pairs with two 64-k blocks per unit at the measured
M up to 16 and fits their relative time per 16-column block slot (``gemv_slot``, see ``fit_gemv_slot``, and
``gemv_kd2_slot``, see ``fit_gemv_kd2``), from which ``plans.gemv_tiles_for`` and ``plans.gemv_kdepth_for`` pick the
variant for each layer shape. The GEMV beyond 16 rows on the layer shapes ``plans.gemv_wide_takes`` gives it
(``gemv_wide_max_m``) keeps the built-in row's setting; it is not measured here.
"""
from __future__ import annotations

import math
import sys

# up to 2048, well past the M near 1024 where the fused wgmma GEMM and dequantize + cuBLAS cross on the H200
# (docs/design.md §Crossovers)
DEFAULT_M = [1, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 768, 1024, 1536, 2048]


def choose(sums: dict[int, dict[str, float]], per_layer: dict | None = None) -> tuple[int, int, int | None]:
    """(gemv_max_m, cublas_min_m, wgmma_min_m) from {M: {path: summed us}}, paths 'gemv', 'dequant_cublas' and
    either 'gemm' or the two GEMM kernels 'gemm_sw' and 'gemm_wg'. With ``per_layer`` ({(layer, M): {path: us}},
    for a row whose cost model decides per layer from cublas_min_m on), cublas_min_m is instead the smallest M of
    at least 256 at which dequantize + cuBLAS beats the wgmma GEMM on some layer (one past the largest M when it
    never does)."""
    from .dispatch import GEMV_LIMIT

    ms = sorted(sums)
    wgmma_min = None
    if any("gemm_wg" in d for d in sums.values()):
        for M in reversed(ms):
            d = sums[M]
            if "gemm_wg" not in d or "gemm_sw" not in d or d["gemm_wg"] > d["gemm_sw"]:
                break
            wgmma_min = M
        sums = {M: dict(d, gemm=d["gemm_wg"] if wgmma_min is not None and M >= wgmma_min else d["gemm_sw"])
                for M, d in sums.items()}
    gemv_max = 0
    for M in ms:
        d = sums[M]
        if M > GEMV_LIMIT or "gemv" not in d or d["gemv"] > d["gemm"]:
            break
        gemv_max = M
    cublas_min = max(ms) + 1
    if per_layer is not None:
        wins = [M for (_, M), d in per_layer.items() if M >= 256 and M > gemv_max and "dequant_cublas" in d
                and d["dequant_cublas"] < d.get("gemm_wg", d.get("gemm", float("inf")))]
        return gemv_max, max(min(wins, default=cublas_min), gemv_max + 1), wgmma_min
    for M in reversed(ms):
        d = sums[M]
        if M <= gemv_max or "dequant_cublas" not in d or d["dequant_cublas"] >= d["gemm"]:
            break
        cublas_min = M
    return gemv_max, max(cublas_min, gemv_max + 1), wgmma_min


def fit_gemv_slot(layers: list[tuple[int, dict[int, float]]], step: float = 0.01) -> dict[int, float] | None:
    """Slot times {2: f2, 3: f3, 4: 1.0} for one token-block count, from measured layers [(blocks per CTA, {tiles:
    us})]: on a ``step`` grid over [0.5, 2], the (f2, f3) whose choices under ``plans.gemv_tiles_for``'s rule lose
    the least summed time against each layer's fastest variant; among equals, the one nearest to the mean measured
    ratios (time per slot against the 4-block variant's, in log terms). None when no layer has two or more blocks
    per CTA and all three variants measured."""
    from .plans import gemv_tiles_by_slot

    used = [(b, t, min(t[tw] for tw in (2, 3, 4))) for b, t in layers
            if b >= 2 and all(tw in t and t[tw] > 0 for tw in (2, 3, 4))]
    if not used:
        return None

    def slots(b, tw):
        return -(-b // tw) * tw

    mean = {tw: sum(math.log((t[tw] / slots(b, tw)) / (t[4] / slots(b, 4))) for b, t, _ in used) / len(used)
            for tw in (2, 3)}
    grid = [round(0.5 + i * step, 6) for i in range(int(round(1.5 / step)) + 1)]
    best = None
    for f2 in grid:
        for f3 in grid:
            f = {2: f2, 3: f3, 4: 1.0}
            regret = sum(t[gemv_tiles_by_slot(b, f)] - fastest for b, t, fastest in used)
            dist = (math.log(f2) - mean[2]) ** 2 + (math.log(f3) - mean[3]) ** 2
            key = (round(regret, 9), dist)
            if best is None or key < best[0]:
                best = (key, f)
    return best[1]


def fit_gemv_kd2(layers: list[tuple[int, dict]], slot: dict[int, float], step: float = 0.01) -> float | None:
    """Slot time of the pairs with two 64-k blocks per unit (key "2x2" of each layer's {tiles: us}) on ``slot``'s
    scale, for one token-block count: on a ``step`` grid over [0.5, 2], the value whose choices under
    ``plans.gemv_kdepth_for``'s rule (against ``gemv_tiles_for``'s pick at ``slot``) lose the least summed time
    against each layer's fastest variant; among equals, the one nearest to the mean measured ratio (time per slot
    against the 4-block variant's, in log terms). None when no layer has two or more blocks per CTA and all four
    variants measured."""
    from .plans import gemv_kdepth_by_slot, gemv_tiles_by_slot

    keys = (2, 3, 4, "2x2")
    used = [(b, t, min(t[k] for k in keys)) for b, t in layers
            if b >= 2 and all(k in t and t[k] > 0 for k in keys)]
    if not used:
        return None

    def pick(b, fk):
        tw = gemv_tiles_by_slot(b, slot)
        return "2x2" if gemv_kdepth_by_slot(b, tw, slot, fk) == 2 else tw

    mean = sum(math.log((t["2x2"] / (-(-b // 2) * 2)) / (t[4] / (-(-b // 4) * 4))) for b, t, _ in used) / len(used)
    best = None
    for i in range(int(round(1.5 / step)) + 1):
        fk = round(0.5 + i * step, 6)
        key = (round(sum(t[pick(b, fk)] - fastest for b, t, fastest in used), 9), abs(math.log(fk) - mean))
        if best is None or key < best[0]:
            best = (key, fk)
    return best[1]


def _gemv_layers(rows, sm_count: int, names: dict) -> dict[int, list[tuple[int, dict]]]:
    """{token blocks: [(blocks per CTA, {variant: us})]} from benchmark rows of the contenders in ``names``
    ({contender: variant key}): each layer's time per variant summed over the measured M of that token-block count
    (1..8, 9..16)."""
    from .plans import gemv_grid

    per: dict = {}
    for r in rows:
        if r.contender in names and r.M <= 16:
            d = per.setdefault((1 if r.M <= 8 else 2, r.N, r.model, r.layer, r.K), {})
            d[names[r.contender]] = d.get(names[r.contender], 0.0) + r.us
    out: dict = {1: [], 2: []}
    for (nb, N, *_), t in per.items():
        NT16, grid = gemv_grid(N, sm_count)
        out[nb].append((-(-NT16 // grid), t))
    return out


_TILES = {"gemv2": 2, "gemv3": 3, "gemv4": 4}


def gemv_kd2_from_rows(rows, sm_count: int, slot: dict[int, dict[int, float]], dtype: str = "float16"
                       ) -> dict[int, float]:
    """{token blocks: slot time of the two-64-k-block pairs} fitted from benchmark rows of the gemv2/gemv3/gemv4
    and gemv2x2 contenders (summed over the measured M of each token-block count, as ``gemv_slot_from_rows``),
    against the tiles' slot times ``slot`` ({token blocks: {tiles: time}}; the H200's for ``dtype`` where it
    lacks one)."""
    from .dispatch import default_gemv_slot

    out = {}
    for nb, layers in _gemv_layers(rows, sm_count, {**_TILES, "gemv2x2": "2x2"}).items():
        fit = fit_gemv_kd2(layers, slot.get(nb) or default_gemv_slot(dtype, nb))
        if fit is not None:
            out[nb] = fit
    return out


def gemv_slot_from_rows(rows, sm_count: int) -> dict[int, dict[int, float]]:
    """{token blocks: slot times} fitted from benchmark rows of the gemv2/gemv3/gemv4 contenders: each layer's
    time per variant summed over the measured M of that token-block count (1..8, 9..16)."""
    out = {}
    for nb, layers in _gemv_layers(rows, sm_count, _TILES).items():
        fit = fit_gemv_slot(layers)
        if fit is not None:
            out[nb] = fit
    return out


def main(args) -> int:
    from ._array import gpu_available, no_gpu_message

    if not gpu_available():
        prog = getattr(args, "prog", "python -m awq_cupy")
        print(no_gpu_message(f"{prog} tune") + " Nothing was measured.", file=sys.stderr)
        return 2
    import cupy

    from . import dispatch
    from .bench import environment, run
    from .jit import arch_of_device
    from .launch import sm_count
    from .plans import has_wgmma

    ms = args.m or DEFAULT_M
    models = [("custom", f"{K}x{N}", K, N) for K, N in args.shapes] if args.shapes else args.models
    arch = arch_of_device(cupy.cuda.runtime.getDevice())
    paths = ["gemv"] + (["gemm_sw", "gemm_wg"] if has_wgmma(arch) else ["gemm"])
    paths += ["dequant_cublas"] if args.dtype == "float16" else []
    tiles = ["gemv2", "gemv3", "gemv4", "gemv2x2"]
    rows = run(models, ms, dtype=args.dtype, group_size=args.group_size, trials=args.trials,
               rotate_mb=args.rotate_mb, contenders=tuple(paths + tiles))
    slot = gemv_slot_from_rows(rows, sm_count(cupy.cuda.runtime.getDevice()))
    kd2 = gemv_kd2_from_rows(rows, sm_count(cupy.cuda.runtime.getDevice()), slot, args.dtype)
    rows = [r for r in rows if r.contender not in tiles]
    sums: dict[int, dict[str, float]] = {}
    per_layer: dict = {}
    for r in rows:
        sums.setdefault(r.M, {}).setdefault(r.contender, 0.0)
        sums[r.M][r.contender] += r.us
        per_layer.setdefault((f"{r.model}/{r.layer}", r.M), {})[r.contender] = r.us
    modelled = dispatch.TABLE.get(arch.key, dispatch.TABLE["default"]).has_cost_model and has_wgmma(arch)
    gemv_max, cublas_min, wgmma_min = choose(sums, per_layer if modelled else None)
    # the built-in cost model (per layer shape from cublas_min_m on) stays with the tuned thresholds
    row = dispatch.Dispatch(gemv_max_m=gemv_max, cublas_min_m=cublas_min, wgmma_min_m=wgmma_min,
                            gemv_wide_max_m=dispatch.builtin_gemv_wide(arch.key, cublas_min),
                            gemv_slot={args.dtype: slot} if slot else None,
                            gemv_kd2_slot={args.dtype: kd2} if kd2 else None,
                            **dispatch.builtin_model(arch.key, cublas_min, wgmma_min))
    env = environment()
    path = args.out or dispatch.table_path()
    if path is None:
        print("AWQ_CUPY_DISPATCH=builtin: pass --out to write the table somewhere", file=sys.stderr)
        return 2
    dispatch.write_table(path, {arch.key: row}, {arch.key: dict(gpu=env["gpu"], date=env["date"], dtype=args.dtype,
                                                               models=[str(m) for m in models],
                                                               sums_us={str(M): d for M, d in sums.items()})})
    print(f"{'M':>5} " + " ".join(f"{p:>15}" for p in paths))
    for M in sorted(sums):
        print(f"{M:5d} " + " ".join(f"{sums[M].get(p, float('nan')):15.1f}" for p in paths))
    print(f"sm_{arch.key}: gemv_max_m={gemv_max}, cublas_min_m={cublas_min}, wgmma_min_m={wgmma_min}, "
          f"GEMV slot times ({args.dtype}, per token blocks) {slot or 'not measured (the H200 fit stays)'}, "
          f"two-k-block pairs {kd2 or 'not measured (the H200 fit stays)'} "
          f"-> written to {path}")
    return 0
