"""A/B timing of the GEMM on a few Mistral-7B cases, timed like `python -m awq_cupy bench`. Usage:
    [AB_CASES=o:64,gate_up:64:256] [AB_MODEL=llama-2-70b] python3 bench/sweeps/ab_gemm.py LABEL [PKG_DIR] RUN...
RUN is "name" or "name:key=value,...": splits, tiles, depth, pend, reduce_cols, ksplit, producers are
launch.run_gemm arguments (a depth outside the shape table is added to it; pend is the wgmma kernel's PEND
template argument, any of 1..3 here; reduce_cols the split-K reduce kernel's columns per thread, 2, 4 or 8;
ksplit=2 two K streams per CTA; producers=0 or 1 the 128- and 256-token tiles' variant without or with x producer
warps; tma=0 or 1 their variant with the x tile pass or reading x through a tensor map);
tile=T makes every M take the token tile T (plans.gemm_token_tile patched); tailsplits=S (with tail=1) splits the
tail launch's K exactly S ways (plans.split_cost patched inside plans.tail_split_cost); notilex=1 skips the x tile
pass (timing only: the GEMM reads the tiles an earlier run of the case left, so put it after a normal run). The gemm_wg family is
narrowed to the variants the runs need, so it compiles in seconds.
AB_DTYPE=bfloat16 runs bf16 activations and weights (default float16).
AB_DEFINES=NAME=VALUE,... compiles the gemm_wg family with those macros (probe builds); AB_NOCHECK=1 skips the
output check (for probes whose values are wrong by design).
PKG_DIR (a directory holding another awq_cupy/ with its kernels_cu/ inside as a package, so that an editable
install's finder does not hand it this tree's kernels) is put first on sys.path when given.
"""
import dataclasses
import os
import sys

args = sys.argv[1:]
label = args.pop(0)
if args and not ":" in args[0] and "/" in args[0]:
    sys.path.insert(0, args.pop(0))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import awq_cupy  # noqa: E402
from awq_cupy import kernels, launch, plans  # noqa: E402
from awq_cupy.bench import MODELS, Timer, rotated_weights  # noqa: E402
from awq_cupy.dtypes import dtype_name, numpy_dtype  # noqa: E402
from awq_cupy.jit import arch_of_device, kernel_dir  # noqa: E402

print(f"# {label}: {awq_cupy.__file__}, kernels from {kernel_dir()}", flush=True)
runs = []
for a in args:
    name, _, kv = a.partition(":")
    runs.append((name, {k: int(v) for k, v in (p.split("=") for p in kv.split(",") if p)}))
token_tile = plans.gemm_token_tile
dtype = dtype_name(os.environ.get("AB_DTYPE", "float16"))   # TypeError for anything but fp16 / bf16 spellings
if numpy_dtype(dtype) == np.uint16:   # no ml_dtypes: float values cast to uint16 would not be bf16 bit patterns
    raise SystemExit("AB_DTYPE=bfloat16 needs ml_dtypes (pip install ml_dtypes)")
print(f"# {dtype}", flush=True)


def run_gemm_without_tile_x(x, w, bias, y, M, kind, arch, sms, batch_invariant, **force):
    """launch.run_gemm without its first launch, the x tile pass (the GEMM reads the tiles an earlier run left)."""
    pc = launch.prepare_gemm(w, M, kind, arch, sms, cp.cuda.get_current_stream().ptr,
                             batch_invariant=batch_invariant, **force)
    if not pc.plan.wgmma or pc._xo or pc._yo:
        raise SystemExit("notilex=1 needs a one-part wgmma plan")
    if pc.plan.producers:
        raise SystemExit(f"notilex=1: {kind} M={M} runs a variant that copies x itself (no x tile pass)")
    for slots, j in pc._y:
        slots[j] = y.data.ptr
    for slots, j in pc._b:
        slots[j] = 0 if bias is launch.NULL else bias
    for one in pc.launches[1:]:
        one.fire()


split_cost, tail_split_cost = plans.split_cost, plans.tail_split_cost


def tail_split_cost_with(splits):
    """plans.tail_split_cost whose tail launch splits K exactly ``splits`` ways (its time stays the model's for
    the model's own split count; a forced tail=1 plan does not compare it)."""
    def forced(K_stages, n_ctas, m_tiles, **kw):
        t, _, _ = split_cost(K_stages, n_ctas, m_tiles, **kw)
        per = -(-K_stages // splits)
        return t, -(-K_stages // per), per

    def tail(*args, **kw):
        plans.split_cost = forced
        try:
            return tail_split_cost.__wrapped__(*args, **kw)   # uncached: the patched split_cost must be seen
        finally:
            plans.split_cost = split_cost
    return tail


def use_tile(kw):
    """Patch plans.gemm_token_tile for a run with tile=T and plans.tail_split_cost for tailsplits=S; returns the
    launch kwargs without tile, tailsplits and notilex, and the run function (launch.run_gemm, or the version
    without the x tile pass for notilex=1)."""
    kw = dict(kw)
    t = kw.pop("tile", None)
    plans.gemm_token_tile = token_tile if t is None else (lambda M, wgmma=False: t)
    s = kw.pop("tailsplits", None)
    if s is not None and (s < 2 or kw.get("tail") != 1):
        raise SystemExit(f"tailsplits={s}: 2 or more, with tail=1")
    plans.tail_split_cost = tail_split_cost if s is None else tail_split_cost_with(s)
    return kw, (run_gemm_without_tile_x if kw.pop("notilex", 0) else launch.run_gemm)


CASES = {"qkv": (256,), "o": (128,), "gate_up": (64, 256), "down": (128,)}
if os.environ.get("AB_CASES"):
    CASES = {}
    for c in os.environ["AB_CASES"].split(","):
        name, *ms = c.split(":")
        CASES[name] = tuple(int(m) for m in ms)


# narrow the gemm_wg family to the variants these runs need (a whole-family compile takes ~35 s on the H200 host)
needed = {kernels.TileXVariant(dtype)}
for _, kw in runs:
    kw, _ = use_tile(kw)
    if "depth" in kw:
        for M in sorted({m for ms in CASES.values() for m in ms}):
            nb, tw, _ = plans.gemm_shape_for(M, kw.get("tiles"), wgmma=True)
            if (nb, tw, kw["depth"]) not in kernels.GEMM_WG_SHAPES:
                kernels.GEMM_WG_SHAPES += ((nb, tw, kw["depth"]),)
for _, kw in runs:
    kw, _ = use_tile(kw)
    for M in sorted({m for ms in CASES.values() for m in ms}):
        nb, tw, depth = plans.gemm_shape_for(M, kw.get("tiles"), wgmma=True, depth=kw.get("depth"))
        # (producers, tma) per PEND: the x producers exist at the default PEND only; an older tree has no tma
        xp_ok = kernels.has_producers((nb, tw, depth))
        xt_ok = getattr(kernels, "has_tma", lambda s: False)((nb, tw, depth))
        for pend in {kw.get("pend")} | set(kernels.gemm_wg_pends((nb, tw, depth))):
            for xp, xt in [(False, False)] + [(True, False)] * (xp_ok and pend is None) + [(False, True)] * xt_ok:
                more = {"tma": True} if xt else {}
                needed.add(kernels.WgmmaVariant(dtype, nb, tw, depth, True, pend, kw.get("ksplit", 1), xp, **more))
                if "ksplit" not in kw and "pend" not in kw and (nb, tw, depth) in kernels.GEMM_WG_KSPLIT_SHAPES:
                    needed.add(kernels.WgmmaVariant(dtype, nb, tw, depth, True, None, 2, xp, **more))
defines = tuple(tuple(d.split("=", 1)) for d in os.environ.get("AB_DEFINES", "").split(",") if d)
fam = dataclasses.replace(kernels.GEMM_WG, variants=lambda arch: tuple(sorted(needed, key=lambda v: v.expr)),
                          defines=defines, asserts=None)
kernels.FAMILIES["gemm_wg"] = fam

arch = arch_of_device(0)
sms = launch.sm_count(0)
timer = Timer()
rng = np.random.default_rng(0)
for name, K, N in MODELS[os.environ.get("AB_MODEL", "mistral-7b")]:
    if name not in CASES:
        continue
    wq = rotated_weights(rng, K, N, 128, dtype=dtype)
    nq = len(wq)
    for M in CASES[name]:
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(numpy_dtype(dtype)))
        ref = None
        line = []
        for run, kw in runs:
            kw, run_gemm = use_tile(kw)
            y = cp.empty((M, N), x.dtype)
            run_gemm(x, wq[0], launch.NULL, y, M, dtype, arch, sms, False, wgmma=True, **kw)
            if ref is None:
                ref = y.astype(cp.float32)
            elif not os.environ.get("AB_NOCHECK") and not bool(cp.allclose(y.astype(cp.float32), ref, rtol=2e-2,
                                                                              atol=2e-2)):
                raise SystemExit(f"{run}: output differs from {runs[0][0]} on {name} M={M}")
            us = timer(lambda i: run_gemm(x, wq[i % nq], launch.NULL, y, M, dtype, arch, sms, False,
                                                  wgmma=True, **kw), max(20, nq), 3)
            line.append(f"{run} {us:7.1f}")
        print(f"{label:8s} {name:8s} M={M:5d}  " + "  ".join(line), flush=True)
    del wq
    cp.get_default_memory_pool().free_all_blocks()
