"""Command line: ``python -m awq_cupy {compile,bench}``."""
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
    print("python -m awq_cupy bench is not built yet (planned: the benchmark issue).", file=sys.stderr)
    return 2


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
    b = sub.add_parser("bench", help="benchmark against cuBLAS fp16 on the GPU")
    b.set_defaults(func=_cmd_bench)
    args = p.parse_args(argv)
    return args.func(args)
