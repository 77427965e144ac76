"""Compare a kernel variant's main loop in SASS with another version of its source (no GPU needed). Usage:

    python3 bench/sass_loop.py FAMILY VARIANT [--arch 90] [--against FILE]

FAMILY is a kernel family of awq_cupy.kernels (gemv_tc, gemm_wg, ...), VARIANT one of its name expressions, e.g.
"awq_gemv_tc_kernel<__half, 1, 3, true>". The variant is compiled from this tree (and, with --against, from FILE
in kernels_cu/, e.g. a gemv_tc_ab.cu made by `git show main:kernels_cu/gemv_tc.cu > kernels_cu/gemv_tc_ab.cu`);
the main loop is the longest backward branch's body with at least 8 tensor-core instructions. Printed: its length
and instruction mix, and against the other version whether it is identical, the same up to register names, or
how similar (difflib ratio on the instructions with registers and addresses erased).

Why: the GEMV's loop sits at its register bound, and changes after it (bench/NOTES.md v24, v26, v27) made ptxas
schedule it differently and cost more than their own work. Check the loop before spending device time.
"""
import argparse
import dataclasses
import difflib
import glob
import os
import re
import shutil
import site
import subprocess
import tempfile
from collections import Counter

from awq_cupy import jit, kernels

_INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACK = re.compile(r"BRA (?:\S+, )?(?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)")
_TENSOR = ("HMMA", "HGMMA")


def instructions(sass: str) -> list:
    """(address, text) of every instruction of `cuobjdump -sass` output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INS.match, sass.splitlines()) if m]


def main_loop(ins: list) -> list:
    """The instructions of the longest loop (backward branch) with at least 8 tensor-core instructions."""
    best: list = []
    for addr, text in ins:
        m = _BACK.search(text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        if sum(any(op in t for op in _TENSOR) for t in body) >= 8 and len(body) > len(best):
            best = body
    return best


def erase(text: str) -> str:
    """An instruction with its registers, predicates and immediates/addresses replaced by placeholders."""
    text = re.sub(r"0x[0-9a-f]+", "#", text)
    text = re.sub(r"\bU?R\d+\b", "R", text)
    return re.sub(r"\bU?P\d\b", "P", text)


def opcode(text: str) -> str:
    return re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text).group(1)


def compiled_sass(family: str, variant: str, arch: str, source: str | None) -> str:
    fam = kernels.FAMILIES[family]
    fam = dataclasses.replace(fam, variants=lambda a: (variant,), **({"source": source} if source else {}))
    cubin = jit.compile_family(fam, jit.ARCHS[arch]).cubin
    wheels = [os.path.join(d, "nvidia", "cu*", "bin", "cuobjdump") for d in site.getsitepackages()]
    tool = shutil.which("cuobjdump") or next(iter(sorted(f for w in wheels for f in glob.glob(w))), None)
    if tool is None:
        raise SystemExit("cuobjdump not found (PATH, or the nvidia-cuda-* wheels' bin folder)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def report(name: str, loop: list) -> None:
    mix = Counter(opcode(t) for t in loop).most_common(10)
    print(f"{name}: {len(loop)} instructions; " + ", ".join(f"{op} {n}" for op, n in mix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("variant")
    ap.add_argument("--arch", default=None, help="jit.ARCHS key (default: 90a for sm_90a-only families, else 90)")
    ap.add_argument("--against", default=None, help="another source file in kernels_cu/ for the same family")
    a = ap.parse_args()
    arch = a.arch or ("90a" if kernels.FAMILIES[a.family].arch_specific else "90")
    this = main_loop(instructions(compiled_sass(a.family, a.variant, arch, None)))
    if not this:
        raise SystemExit("no loop with tensor-core instructions found")
    report("this tree", this)
    if a.against:
        other = main_loop(instructions(compiled_sass(a.family, a.variant, arch, a.against)))
        report(a.against, other)
        if this == other:
            print("identical")
        elif [erase(t) for t in this] == [erase(t) for t in other]:
            print("the same up to register names")
        else:
            ratio = difflib.SequenceMatcher(a=[erase(t) for t in this], b=[erase(t) for t in other],
                                            autojunk=False).ratio()
            print(f"different schedules: similarity {ratio:.3f}")


if __name__ == "__main__":
    main()
