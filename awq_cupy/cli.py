"""Command line: ``python -m awq_cupy {compile,bench,tune}``."""
from __future__ import annotations

import argparse
import sys


def _cmd_compile(args) -> int:
    from .jit import CompileError
    from .kernels import compile_all

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    fams = [f.strip() for f in args.family.split(",")] if args.family else None
    try:
        rows = compile_all(archs, fams, log=lambda m: print(m, file=sys.stderr))
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'family':<10} {'arch':<7} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}  variant")
    bad = []
    for r in rows:
        spills = r["spill_stores"] + r["spill_loads"]
        print(f"{r['family']:<10} {r['arch']:<7} {r['registers']:>4} "
              f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['stack_frame']:>5} {r['static_smem']:>6}  "
              f"{r['variant']}")
        if r["hot"] and spills:
            bad.append(f"{r['variant']} on {r['arch']} spills ({r['spill_stores']} B stores, "
                       f"{r['spill_loads']} B loads)")
        if r["static_smem"] > r["smem_limit"]:
            bad.append(f"{r['variant']} on {r['arch']} uses {r['static_smem']} B static smem > {r['smem_limit']}")
    for b in bad:
        print(f"error: {b}", file=sys.stderr)
    print(f"{len(rows)} kernel variants compiled, {len(bad)} problems", file=sys.stderr)
    return 1 if bad else 0


def _cmd_bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def _cmd_tune(args) -> int:
    from .tune import main as tune_main

    return tune_main(args)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _shape_list(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            K, N = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shapes are KxN pairs like 4096x6144, got {item!r}") from None
        if K <= 0 or N <= 0 or K % 8 or N % 8:
            raise argparse.ArgumentTypeError(f"shape {item!r}: K and N must be positive multiples of 8")
        out.append((K, N))
    return out


def main(argv=None) -> int:
    from .jit import ARCHS

    p = argparse.ArgumentParser(prog="python -m awq_cupy", description="awq_cupy command line")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile every kernel variant (no GPU needed) and report "
                                       "registers/spills/shared memory")
    c.add_argument("--arch", default=",".join(ARCHS),
                   help=f"comma-separated archs (default: all of {','.join(ARCHS)})")
    c.add_argument("--family", default=None, help="comma-separated kernel families (default: all)")
    c.set_defaults(func=_cmd_compile)
    from .bench import CONTENDERS, MODELS, PATHS

    b = sub.add_parser("bench", help="benchmark against cuBLAS fp16 on the GPU (the project's main job)")
    b.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mistral-7b", "llama-2-70b"],
                   help="model layer sets (default: both)")
    b.add_argument("--shapes", type=_shape_list, default=None, help="custom layers instead, e.g. 4096x6144,14336x4096")
    b.add_argument("--m", type=_int_list, default=None, help="comma-separated M values (default 1..4096)")
    b.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    b.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16", help="same as --dtype bfloat16")
    b.add_argument("--group-size", type=int, default=128)
    b.add_argument("--trials", type=int, default=5)
    b.add_argument("--rotate-mb", type=int, default=512, help="MB of weight copies rotated per contender")
    b.add_argument("--contenders", nargs="+", choices=CONTENDERS + PATHS, default=list(CONTENDERS),
                   help="what to time (default: %(default)s); gemv1..gemv4, gemv2x2 (pairs of two 64-k blocks), gemm "
                        "force one awq_cupy path")
    b.add_argument("--decode", action="store_true",
                   help="only the decode step (eager and CUDA graph against cuBLAS fp16) and the host us per call")
    b.add_argument("--no-decode", dest="no_decode", action="store_true",
                   help="only the per-layer kernel sweep (the default run does both)")
    b.add_argument("--quick", action="store_true", help="Mistral-7B, M in 1,16,64,256,1024, 3 trials (~1 minute)")
    b.add_argument("--json", default="bench_results.json", help="where to write the JSON results")
    b.add_argument("--plot", default="bench_results.png", help="where to write the PNG plot (needs matplotlib)")
    b.set_defaults(func=lambda a: _cmd_bench(a))
    t = sub.add_parser("tune", help="measure which kernel is fastest at each M on this GPU and write the "
                                    "dispatch table matmul uses")
    t.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mistral-7b"],
                   help="model layer sets to sum over (default: mistral-7b)")
    t.add_argument("--shapes", type=_shape_list, default=None, help="custom layers instead, e.g. 4096x6144")
    t.add_argument("--m", type=_int_list, default=None, help="comma-separated M values (default 1..2048)")
    t.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    t.add_argument("--group-size", type=int, default=128)
    t.add_argument("--trials", type=int, default=3)
    t.add_argument("--rotate-mb", type=int, default=512, help="MB of weight copies rotated per contender")
    t.add_argument("--out", default=None, help="where to write the table (default: awq_cupy.dispatch.table_path())")
    t.set_defaults(func=lambda a: _cmd_tune(a))
    args = p.parse_args(argv)
    return args.func(args)
