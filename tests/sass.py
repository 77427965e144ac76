"""Compare a kernel variant's main loop in SASS with another version of its source (no GPU needed). Usage:

    python3 tests/sass.py FAMILY VARIANT [--arch 90] [--against FILE] [--hazards]

FAMILY is a kernel family of awq_cupy.kernels (gemv_tc, gemm_wg, ...), VARIANT one of its name expressions, e.g.
"awq_gemv_tc_kernel<__half, 1, 3, true>". The variant is compiled from this tree (and, with --against, from FILE,
e.g. a /tmp/gemv_tc_ab.cu made by `git show main:kernels_cu/gemv_tc.cu > /tmp/gemv_tc_ab.cu`; its includes resolve
next to it first, then in kernels_cu/);
the main loop is the longest backward branch's body with at least 8 tensor-core instructions. Printed: its length
and instruction mix, and against the other version whether it is identical, the same up to register names, or
how similar (difflib ratio on the instructions with registers and addresses erased). With --hazards it lists
instead the instructions that write registers an issued wgmma may still read as its A operand
(wgmma_register_hazards; tests/test_kernels.py runs it on every wgmma kernel).

Why: the GEMV's loop sits at its register bound, and changes after it (docs/history.md v24, v26, v27) made ptxas
schedule it differently and cost more than their own work. Check the loop before spending device time. Also a
module of the test suite (tests/test_kernels.py imports it).
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


def loops(ins: list) -> list:
    """The (address, text) bodies of every loop: from a backward branch's target to the branch."""
    found = []
    for addr, text in ins:
        m = _BACK.search(text)
        if m and int(m.group(1), 16) < addr:
            found.append([(a, t) for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return found


def main_loop(ins: list) -> list:
    """The instructions of the longest loop (backward branch) with at least 8 tensor-core instructions."""
    best: list = []
    for body in loops(ins):
        texts = [t for _, t in body]
        if sum(any(op in t for op in _TENSOR) for t in texts) >= 8 and len(texts) > len(best):
            best = texts
    return best


def erase(text: str) -> str:
    """An instruction with its registers, predicates and immediates/addresses replaced by placeholders."""
    text = re.sub(r"0x[0-9a-f]+", "#", text)
    text = re.sub(r"\bU?R\d+\b", "R", text)
    return re.sub(r"\bU?P\d\b", "P", text)


def opcode(text: str) -> str:
    return re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text).group(1)


def cuobjdump() -> str:
    """The cuobjdump executable: on PATH, or from the nvidia-cuda-cuobjdump wheel (the test extra, with
    nvidia-cuda-nvdisasm)."""
    wheels = [os.path.join(d, "nvidia", "cu*", "bin", "cuobjdump") for d in site.getsitepackages()]
    tool = shutil.which("cuobjdump") or next(iter(sorted(f for w in wheels for f in glob.glob(w))), None)
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (PATH, or the nvidia-cuda-cuobjdump wheel's bin folder)")
    return tool


def cubin_sass(cubin: bytes) -> str:
    """`cuobjdump -sass` of a cubin (every function in it). cuobjdump runs nvdisasm, which it looks for beside
    itself (the nvidia-cuda-nvdisasm wheel puts it there), on PATH or at NVDISASM_PATH."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def functions(sass: str) -> dict:
    """Mangled function name -> its (address, text) instructions, from `cuobjdump -sass` output."""
    out: dict = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None:
            m = _INS.match(line)
            if m:
                out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def compiled_sass(family: str, variant: str, arch: str, source: str | None) -> str:
    fam = kernels.FAMILIES[family]
    other = {}
    if source:
        other = {"source": os.path.basename(source), "source_dir": os.path.dirname(os.path.abspath(source))}
    fam = dataclasses.replace(fam, variants=lambda a: (variant,), asserts=None, **other)
    try:
        return cubin_sass(jit.compile_family(fam, jit.ARCHS[arch]).cubin)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


# Opcodes that write no general register as their first operand (stores, reductions without a result, barriers,
# branches, predicate and uniform-datapath instructions, the wgmma's own bookkeeping). ATOM returns the old value
# into its first operand, so it is not one of them.
_NO_REG_WRITE = ("ST", "RED", "BRA", "BAR", "SYNCS", "WARPGROUP", "DEPBAR", "LDGDEPBAR", "HGMMA", "EXIT",
                 "RET", "CALL", "NOP", "FENCE", "MEMBAR", "YIELD", "BSSY", "BSYNC", "WARPSYNC", "ACQBULK", "UBLKCP",
                 "UTMA", "ERRBAR", "CCTL", "ISETP", "FSETP", "HSETP", "DSETP", "PLOP3", "VOTEU", "R2UR", "ELECT",
                 "PREEXIT", "BMOV", "BREAK", "LDGSTS", "ARRIVES", "CGAERRBAR")


def _written(text: str) -> set:
    """General registers an instruction writes (its first operand, with the width of a wide result)."""
    op = opcode(text)
    if op.startswith("U") or any(op.startswith(p) for p in _NO_REG_WRITE):
        return set()
    m = re.match(r"(?:@!?U?P\w+\s+)?(\S+)\s+R(\d+)\b", text)
    if not m:
        return set()
    full = m.group(1)
    n = 4 if (".128" in full or (full.startswith("LDSM") and full.endswith(".4"))) else \
        2 if (".64" in full or ".WIDE" in full or full == "CS2R" or (full.startswith("LDSM") and full.endswith(".2"))) \
        else 1
    r0 = int(m.group(2))
    return set(range(r0, r0 + n))


def wgmma_register_hazards(ins: list) -> list:
    """Instructions of a function's loops that write a register an issued HGMMA may still be reading as its A
    operand (A from registers: a wgmma reads them until a WARPGROUP.DEPBAR retires its group). Each loop (backward
    branch) with HGMMAs is walked twice, so that writes in the next iteration count too; groups are closed by an
    HGMMA with gsb0 and retired by `WARPGROUP.DEPBAR.LE gsb0, N` down to the N newest. ptxas serializes such code
    itself where it sees it (message C7513), but not across a loop's back edge (docs/history.md v34)."""
    found = []
    for body in loops(ins):
        if not any(opcode(t) == "HGMMA" for _, t in body):
            continue
        pending, open_group, busy = [], set(), set()
        for lap in range(2):
            for a, t in body:
                op = opcode(t)
                if op == "HGMMA":
                    operands = [o.strip() for o in t.split(None, 1)[1].split(",")]
                    if re.fullmatch(r"R\d+", operands[1]):
                        r0 = int(operands[1][1:])
                        open_group |= set(range(r0, r0 + 4))
                    if "gsb0" in t:
                        pending.append(open_group)
                        open_group = set()
                    busy = set().union(*pending, open_group)
                elif op == "WARPGROUP" and "DEPBAR" in t:
                    keep = int(t.rsplit(",", 1)[1].strip(), 0)
                    pending = pending[len(pending) - keep:] if keep else []
                    busy = set().union(*pending, open_group)
                elif lap == 1 and busy and _written(t) & busy:   # (busy: the A registers still in flight)
                    found.append(f"{a:#06x} {t}")
    return sorted(set(found))


def report(name: str, loop: list) -> None:
    mix = Counter(opcode(t) for t in loop).most_common(10)
    print(f"{name}: {len(loop)} instructions; " + ", ".join(f"{op} {n}" for op, n in mix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("variant")
    ap.add_argument("--arch", default=None, help="jit.ARCHS key (default: 90a for sm_90a-only families, else 90)")
    ap.add_argument("--against", default=None, help="another source file (a path) for the same family")
    ap.add_argument("--hazards", action="store_true",
                    help="list the writes to A registers of wgmmas in flight (wgmma_register_hazards) instead")
    a = ap.parse_args()
    arch = a.arch or ("90a" if kernels.FAMILIES[a.family].arch_specific else "90")
    if a.hazards:
        found = wgmma_register_hazards(instructions(compiled_sass(a.family, a.variant, arch, a.against)))
        print("\n".join(found) if found else "no write to the A registers of a wgmma in flight")
        return
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
