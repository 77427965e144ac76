"""Command line: ``awq-cupy`` / ``python -m awq_cupy`` {inspect,convert,compile,bench,tune}."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_compile_source(args) -> int:
    from .jit import CompileError, compile_file

    if args.family:
        print("error: --family is for the library's kernels, not with --source", file=sys.stderr)
        return 2
    if not args.name:
        print("error: --source needs at least one --name (a kernel name expression, e.g. 'my_kernel<__half>')",
              file=sys.stderr)
        return 2
    defines = []
    for d in args.define:
        k, _, v = d.partition("=")
        defines.append((k, v or "1"))
    if args.arch is not None:
        archs = args.arch
    else:   # every generic target: the arch-specific ones (90a) only when asked for, as code for them is
        from .jit import ARCHS

        archs = [a for a in ARCHS if not a.endswith("a")]
    for a in archs:
        try:
            prog = compile_file(args.source, args.name, arch=a, include_dirs=args.include, defines=defines)
        except CompileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(prog.report())
        for line in prog.log.splitlines():       # NVRTC's warnings (the rest of the log is ptxas -v)
            if "warning" in line.lower():
                print(line, file=sys.stderr)
        spills = [n for n, r in prog.resources.items() if r.spill_stores or r.spill_loads]
        if spills:
            print(f"warning: {', '.join(spills)} spill registers on {prog.arch.target}", file=sys.stderr)
    return 0


def _cmd_compile(args) -> int:
    from .jit import CompileError
    from .kernels import compile_all

    if args.source:
        return _cmd_compile_source(args)
    if args.name or args.define or args.include:
        print("error: --name, -D and -I go with --source FILE", file=sys.stderr)
        return 2

    try:
        rows = compile_all(args.arch, args.family, log=lambda m: print(m, file=sys.stderr))   # None: every arch
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


def _cmd_inspect(args) -> int:
    from .inspection import main as inspect_main

    return inspect_main(args.path, as_json=args.json, scan=not args.no_scan)


def _cmd_convert(args) -> int:
    from .convert import main as convert_main

    return convert_main(args.src, args.dst, group_size=args.group_size, zero_point=not args.no_zero_point,
                        skip=tuple(args.skip), max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                        progress=True if args.progress else None)


def _arch_list(text: str) -> list[str]:
    """``--arch`` values: keys of jit.ARCHS (``sm_`` prefix optional); ``90`` means the whole Hopper build, sm_90
    and sm_90a (the wgmma GEMM runs only as sm_90a), which is what an H100/H200 runs."""
    from .jit import ARCHS

    out = []
    for item in text.split(","):
        a = item.strip().lower()
        a = a[3:] if a.startswith("sm_") else a
        if not a:
            continue
        if a not in ARCHS:
            raise argparse.ArgumentTypeError(f"unknown arch {item.strip()!r}; supported: {', '.join(ARCHS)}")
        for key in (("90", "90a") if a == "90" else (a,)):
            if key not in out:
                out.append(key)
    if not out:
        raise argparse.ArgumentTypeError(f"no arch given in {text!r}; supported: {', '.join(ARCHS)}")
    return out


def _family_list(text: str) -> list[str]:
    from .kernels import FAMILIES

    fams = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown or not fams:
        raise argparse.ArgumentTypeError(f"unknown kernel family {(unknown or [text])[0]!r}; supported: "
                                         f"{', '.join(FAMILIES)}")
    return fams


def _group_size(text: str) -> int:
    try:
        g = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"group size must be an integer, got {text!r}") from None
    if g != -1 and g <= 0:
        raise argparse.ArgumentTypeError(f"group size must be positive or -1 (one group per row), got {g}")
    return g


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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _prog() -> str:
    """How the user called us: ``awq-cupy`` for the console script, ``python -m awq_cupy`` for the module."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "python -m awq_cupy" if name in ("", "-c", "__main__.py", "-m") else name


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from . import __version__
    from .jit import ARCHS
    from .kernels import FAMILIES

    prog = prog or _prog()
    p = argparse.ArgumentParser(
        prog=prog, description="awq_cupy: AWQ 4-bit matmuls on CuPy. Checkpoint tools (inspect, convert) and "
        "the kernel compile check run without a GPU; bench and tune need one.")
    p.add_argument("--version", action="version", version=f"awq_cupy {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    i = sub.add_parser("inspect", help="list a checkpoint's layers and tensors and scan its scales and zeros",
                       description="Layers (format, K, N, group size, bytes, bias), other tensors, and a scan of "
                       "scales/zeros/biases for NaN, Inf, zero or negative scales and out-of-range zeros. Exit "
                       "status: 0 no problems, 1 problems found, 2 unreadable checkpoint.")
    i.add_argument("path", help="checkpoint directory (or one .safetensors file beside its config.json)")
    i.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    i.add_argument("--no-scan", action="store_true", help="only read the headers: skip the scan of scales and zeros")
    i.set_defaults(func=_cmd_inspect)

    v = sub.add_parser("convert", help="write a checkpoint as an AutoAWQ gemm one: from any AWQ format, or "
                                       "quantize a dense fp16/bf16 one by round-to-nearest",
                       description="IN is an AWQ checkpoint (gemm, gemv, gemv_fast or marlin: rewritten "
                       "losslessly as gemm) or a dense safetensors model (its linear layers quantized by "
                       "round-to-nearest; embeddings, norms and lm_head kept). Config and tokenizer files are "
                       "carried over.")
    v.add_argument("src", metavar="IN", help="source checkpoint directory")
    v.add_argument("dst", metavar="OUT", help="output directory")
    v.add_argument("--group-size", type=_group_size, default=None,
                   help="group size for a dense input (default 128; -1 = one group per row); for an AWQ input it "
                        "must equal the checkpoint's")
    v.add_argument("--no-zero-point", action="store_true",
                   help="symmetric quantization (zero point 8) for a dense input")
    v.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="keep modules whose name contains PATTERN dense (repeatable; written as "
                        "modules_to_not_convert)")
    v.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="shard the output above SIZE, e.g. 5GB or 2GiB (default: one file)")
    v.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in OUT")
    v.add_argument("--progress", action="store_true",
                   help="always print progress (default: only on a terminal, for large models)")
    v.set_defaults(func=_cmd_convert)

    c = sub.add_parser("compile", help="compile every kernel variant (no GPU needed) and report "
                                       "registers/spills/shared memory",
                       description="Compile the kernels with NVRTC into the cache and print each variant's "
                       "registers, spills, stack and static shared memory. Exit status 1 when a hot kernel "
                       "spills or exceeds shared memory.")
    c.add_argument("--arch", type=_arch_list, default=None, metavar="ARCHS",
                   help=f"comma-separated targets out of {', '.join(ARCHS)} (sm_ prefix optional; default: all). "
                        "90 means sm_90 and sm_90a, the two an H100/H200 runs (sm_90a holds the wgmma GEMM); "
                        "90a alone is only the wgmma build")
    c.add_argument("--family", type=_family_list, default=None, metavar="FAMILIES",
                   help=f"comma-separated kernel families out of {', '.join(FAMILIES)} (default: all)")
    c.add_argument("--source", metavar="FILE", default=None,
                   help="compile a .cu file of your own instead, with the library's options and headers, and print "
                        "ptxas's report per kernel (default arch: every generic target; name 90a for wgmma code)")
    c.add_argument("--name", action="append", default=[], metavar="EXPR",
                   help="with --source: a kernel to export, as a C++ name expression (repeatable)")
    c.add_argument("-D", dest="define", action="append", default=[], metavar="NAME[=VALUE]",
                   help="with --source: a preprocessor define (repeatable)")
    c.add_argument("-I", dest="include", action="append", default=[], metavar="DIR",
                   help="with --source: another folder for #include \"...\" (the file's own folder comes first)")
    c.set_defaults(func=_cmd_compile)
    from .bench import CONTENDERS, MODELS, PATHS
    from .peers import PEERS

    b = sub.add_parser("bench", help="benchmark against cuBLAS fp16 on the GPU (the project's main job)",
                       description="Per-layer kernel times and the decode step against cuBLAS fp16, in one run "
                       "(docs/benchmarking.md). Needs a CUDA GPU.")
    b.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mistral-7b", "llama-2-70b"],
                   help="model layer sets (default: both)")
    b.add_argument("--shapes", type=_shape_list, default=None,
                   help="custom layers instead, KxN comma-separated, e.g. 4096x6144,14336x4096")
    b.add_argument("--m", type=_int_list, default=None, help="comma-separated M values (default 1..4096)")
    b.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="activation dtype (default: %(default)s)")
    b.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16", help="same as --dtype bfloat16")
    b.add_argument("--group-size", type=_group_size, default=128, help="quantization group size (default: 128)")
    b.add_argument("--trials", type=_positive, default=5, help="timed trials per cell; the median is reported "
                                                             "(default: %(default)s)")
    b.add_argument("--rotate-mb", type=_positive, default=512,
                   help="MB of weight copies rotated per contender, so each call reads cold weights "
                        "(default: %(default)s)")
    b.add_argument("--contenders", nargs="+", choices=CONTENDERS + PATHS + tuple(PEERS), default=list(CONTENDERS),
                   help="what to time (default: %(default)s); gemv1..gemv4, gemv2x2 (pairs of two 64-k blocks), gemm "
                        "force one awq_cupy path; " + ", ".join(PEERS) + ": another library, where it and torch "
                        "import (left out with the reason otherwise)")
    b.add_argument("--decode", action="store_true",
                   help="only the decode step (eager and CUDA graph against cuBLAS fp16) and the host us per call")
    b.add_argument("--no-decode", dest="no_decode", action="store_true",
                   help="only the per-layer kernel sweep (the default run does both)")
    b.add_argument("--quick", action="store_true", help="Mistral-7B, M in 1,16,64,256,1024, 3 trials (~1 minute)")
    b.add_argument("--json", default="bench_results.json", help="where to write the JSON results "
                                                                "(default: %(default)s)")
    b.add_argument("--plot", default="bench_results.png", help="where to write the PNG plot, if matplotlib is "
                                                               "installed (default: %(default)s)")
    b.set_defaults(func=_cmd_bench)
    from .dispatch import table_path

    default_table = table_path()
    t = sub.add_parser("tune", help="measure which kernel is fastest at each M on this GPU and write the "
                                    "dispatch table matmul uses",
                       description="Needs a CUDA GPU. The table is read by every later process (and by this one "
                       "after awq_cupy.settings.reload()).")
    t.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mistral-7b"],
                   help="model layer sets to sum over (default: mistral-7b)")
    t.add_argument("--shapes", type=_shape_list, default=None, help="custom layers instead, e.g. 4096x6144")
    t.add_argument("--m", type=_int_list, default=None, help="comma-separated M values (default 1..2048)")
    t.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="activation dtype (default: %(default)s)")
    t.add_argument("--group-size", type=_group_size, default=128, help="quantization group size (default: 128)")
    t.add_argument("--trials", type=_positive, default=3, help="timed trials per cell (default: %(default)s)")
    t.add_argument("--rotate-mb", type=_positive, default=512,
                   help="MB of weight copies rotated per contender (default: %(default)s)")
    t.add_argument("--out", default=None,
                   help=f"where to write the table (default: {default_table}, from AWQ_CUPY_DISPATCH or the "
                        "compile cache folder)" if default_table is not None else
                   "where to write the table (required: AWQ_CUPY_DISPATCH=builtin disables the default)")
    t.set_defaults(func=_cmd_tune)
    return p


def main(argv=None) -> int:
    prog = _prog()
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.cmd is None:
        p.print_help()
        return 0
    args.prog = prog
    return args.func(args)
