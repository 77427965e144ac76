"""Every kernel family x every arch of ``jit.ARCHS`` compiles with NVRTC on CPU, with its resources in bounds.

One ``kernels.compile_all()`` per test session into the configured compile cache (``AWQ_CUPY_CACHE_DIR``; CI's
compile check fills the same folder just before, so the kernels are compiled once per CI run; a cold cache costs
about 2.5 minutes on 2 cores), read back from disk; the tests then read its rows and the ``CompiledFamily``
objects. With ``AWQ_CUPY_DISABLE_CACHE=1`` it compiles into a fresh folder of the session instead. A cache entry
is keyed by the full source, options, arch and NVRTC version and checked on read (a corrupt one is recompiled), so
a warm entry is the same cubin and resource report a fresh compile gives.
"""
import os
import re

import pytest

from awq_cupy import jit, kernels
from gpu_util import two_per_sm_wgmma_variants

_PLAIN_C_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Compiled:
    def __init__(self, rows, families):
        self.rows = rows            # compile_all's rows
        self.families = families    # (family name, arch key) -> CompiledFamily

    def row(self, family, arch, variant):
        found = [r for r in self.rows if (r["family"], r["arch"], r["variant"]) == (family, arch, variant)]
        assert len(found) == 1, f"{family} {variant} on {arch}: {len(found)} rows"
        return found[0]


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        if not jit._cache_enabled():
            mp.setenv("AWQ_CUPY_CACHE_DIR", str(tmp_path_factory.mktemp("compile_all_cache")))
            mp.delenv("AWQ_CUPY_DISABLE_CACHE", raising=False)
        mp.setattr(jit, "_compiled", {})
        rows = kernels.compile_all()
        families = {(f.name, a.key): jit.compile_family(f, a)
                    for a in jit.ARCHS.values() for f in kernels.FAMILIES.values() if f.supports(a)}
    return Compiled(rows, families)


def _targets():
    return [(f, a) for a in jit.ARCHS.values() for f in kernels.FAMILIES.values() if f.supports(a)]


def test_every_variant_compiled(compiled):
    expected = {(f.name, a.target, v) for f, a in _targets() for v in f.names(a)}
    got = [(r["family"], r["arch"], r["variant"]) for r in compiled.rows]
    assert len(got) == len(set(got)), "duplicate rows"
    assert set(got) == expected, (sorted(expected - set(got)), sorted(set(got) - expected))
    portable = {f for f in kernels.FAMILIES.values() if not f.arch_specific}
    for arch in ("75", "80", "86", "89", "90"):
        assert {f for f, a in _targets() if a.key == arch} == portable, arch
    assert {f for f, a in _targets() if a.key == "90a"} == set(kernels.FAMILIES.values()) - portable


@pytest.mark.parametrize("family,arch", [(f.name, a.key) for f, a in _targets()])
def test_lowered_names_resolve(compiled, family, arch):
    c = compiled.families[(family, arch)]
    fam = kernels.FAMILIES[family]
    assert c.cubin.startswith(b"\x7fELF") and c.arch == jit.ARCHS[arch].target
    assert list(c.lowered) == list(fam.names(jit.ARCHS[arch]))
    for variant, symbol in c.lowered.items():
        assert symbol, variant
        assert symbol.startswith("_Z") or _PLAIN_C_NAME.fullmatch(symbol), (variant, symbol)
        if "<" in variant:
            assert symbol.startswith("_Z"), (variant, symbol)     # a template instantiation is mangled
        assert symbol.encode() + b"\0" in c.cubin, f"{symbol} ({variant}) is not in the cubin's symbols"
        assert variant in c.resources, f"no ptxas report for {variant}"


def test_hot_kernels_do_not_spill(compiled):
    spills = [f"{r['variant']} on {r['arch']}: {r['spill_stores']} B stores, {r['spill_loads']} B loads, "
              f"{r['stack_frame']} B stack" for r in compiled.rows
              if r["hot"] and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, "\n".join(spills)


def test_resources_within_arch_limits(compiled):
    for r in compiled.rows:
        arch = next(a for a in jit.ARCHS.values() if a.target == r["arch"])
        assert r["smem_limit"] == arch.smem_optin
        assert 0 <= r["static_smem"] <= arch.smem_optin, r
        assert 0 < r["registers"] <= 255, r


@pytest.mark.parametrize("arch", [a.key for a in jit.ARCHS.values() if kernels.GEMM_TC.supports(a)])
def test_gemm_sw_shared_memory_and_registers_fit(compiled, arch):
    """The mma.sync GEMM's x slots plus static smem fit the opt-in limit, at 256 threads without spills."""
    a = jit.ARCHS[arch]
    for dtype in kernels.gemm_dtypes(a):
        for nb, tw, depth in kernels.GEMM_SHAPES:
            for ga in (True, False):
                v = kernels.GemmVariant(dtype, nb, tw, depth, ga)
                variant = v.expr
                row = compiled.row("gemm_tc", a.target, variant)
                dynamic = v.smem_bytes
                assert dynamic + row["static_smem"] <= a.smem_optin, (variant, a.target, dynamic)
                assert row["spill_stores"] == 0 and row["spill_loads"] == 0, (variant, a.target, row)


def test_gemm_wg_only_for_sm90a_and_fits(compiled):
    """The wgmma GEMM is built for sm_90a alone; every variant fits shared memory and does not spill."""
    for a in jit.ARCHS.values():
        assert kernels.GEMM_WG.supports(a) == (a.key == "90a"), a.key
    a = jit.ARCHS["90a"]
    for dtype in kernels.gemm_dtypes(a):
        for nb, tw, depth in kernels.GEMM_WG_SHAPES:
            for ga in (True, False):
                v = kernels.WgmmaVariant(dtype, nb, tw, depth, ga)
                variant = v.expr
                row = compiled.row("gemm_wg", a.target, variant)
                assert v.smem_bytes + row["static_smem"] <= a.smem_optin, (variant, row)
                assert row["spill_stores"] == 0 and row["spill_loads"] == 0, (variant, row)


def test_gemm_wg_two_per_sm_variants_fit_two_ctas_per_sm(compiled):
    """The variants that run two CTAs per SM by design (gpu_util.two_per_sm_wgmma_variants) fit two CTAs' registers
    and shared memory on sm_90a. Left to ptxas, the 128-token PEND 2 variant's fp16 build took 131 registers with
    NVRTC 13.0 (one CTA per SM on the device) and 128 with 13.5; the kernels' launch bounds hold both to 128."""
    a = jit.ARCHS["90a"]
    regs_per_sm, smem_per_sm, smem_reserved = 65536, 228 * 1024, 1024   # sm_90: per SM, and per CTA reserved

    def fits_two(v):
        row = compiled.row("gemm_wg", a.target, v.expr)
        per_thread = -(-row["registers"] // 8) * 8   # allocated per warp in 256-register units
        assert 2 * v.threads * per_thread <= regs_per_sm, (v.expr, row["registers"])
        assert 2 * (v.smem_bytes + row["static_smem"] + smem_reserved) <= smem_per_sm, (v.expr, row)

    for dtype in kernels.gemm_dtypes(a):
        for v in two_per_sm_wgmma_variants(dtype):
            fits_two(v)


def test_wgmma_header_is_generated_from_the_generator(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    gen = root / "tools" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", gen)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "kernels_cu").mkdir()
    monkeypatch.chdir(tmp_path)
    mod.main()
    assert (tmp_path / "kernels_cu" / "wgmma.cuh").read_text() == (root / "kernels_cu" / "wgmma.cuh").read_text(), \
        "kernels_cu/wgmma.cuh is stale: run python3 tools/gen_wgmma.py"


def test_bf16_tensor_core_variants_only_from_sm80(compiled):
    for a in jit.ARCHS.values():
        if a.arch_specific:
            continue
        names = set(compiled.families[("gemm_tc", a.key)].lowered) | set(compiled.families[("dequant", a.key)].lowered)
        def exprs(dtype):
            vs = {kernels.GemmVariant(dtype, nb, tw, p, True) for nb, tw, p in kernels.GEMM_SHAPES}
            vs |= {kernels.ReduceVariant(dtype), kernels.DequantTilesVariant(dtype)}
            return {v.expr for v in vs}

        bf16, fp16 = exprs("bfloat16"), exprs("float16")
        assert fp16 <= names, (a.target, sorted(fp16 - names))
        if a.mma_k16:
            assert bf16 <= names, (a.target, sorted(bf16 - names))
        else:
            assert not bf16 & names, (a.target, sorted(bf16 & names))
            tc = [n for n in compiled.families[("gemm_tc", a.key)].lowered if "bfloat16" in n]
            assert not tc, (a.target, tc)


def test_compile_all_rejects_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch '61'"):
        kernels.compile_all(["61"])


def test_second_compile_all_reads_the_disk_cache(tmp_path, monkeypatch):
    """A new process (empty memory cache) over the same cache folder compiles nothing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(cache))
    monkeypatch.setattr(jit, "_compiled", {})
    first = kernels.compile_all(["86"], ["dequant"])
    assert not any(r["cached"] for r in first)
    monkeypatch.setattr(jit, "_compiled", {})
    calls = []
    monkeypatch.setattr(jit, "_nvrtc_compile", lambda *a, **k: calls.append(a) or pytest.fail("recompiled"))
    second = kernels.compile_all(["86"], ["dequant"])
    assert all(r["cached"] for r in second) and not calls
    assert [dict(r, cached=None) for r in first] == [dict(r, cached=None) for r in second]


def test_gemv_trace_build_compiles(tmp_path, monkeypatch):
    """bench/probes/gemv_trace.py's GEMV build (AWQ_GEMV_TRACE: timestamps per CTA) keeps compiling, unspilled."""
    import dataclasses

    monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_compiled", {})
    names = tuple(kernels.GemvVariant("float16", nb, tw, True).expr for nb, tw in ((1, 2), (1, 4), (2, 3)))
    names += tuple(kernels.GemvVariant("float16", nb, 2, True, 2).expr for nb in (1, 2))   # the KD 2 pairs too
    fam = dataclasses.replace(kernels.GEMV_TC, name="gemv_trace", defines=(("AWQ_GEMV_TRACE", "1"),),
                              variants=lambda a: names)
    c = jit.compile_family(fam, jit.ARCHS["90"])
    assert tuple(c.lowered) == names
    assert all(c.resources[n].spill_stores == 0 for n in names), c.resources


def test_gemv_compiled_for_model_shapes_does_not_spill(tmp_path, monkeypatch):
    """The GEMVs matmul compiles for a launch shape on sm_90 (plans.gemv_specializes) stay unspilled and within the
    generic variant's registers, for the benchmark's layers (Mistral-7B, Llama-2-70B) at 1 and 16 tokens (compiled
    for the token count too where plans.gemv_compiled_tokens says so), fp16 and bf16; and their trace builds
    (bench/probes/gemv_trace.py) compile too."""
    import types

    from awq_cupy import plans
    from awq_cupy.bench import MODELS
    from awq_cupy.layout import padded_sizes

    if not jit._cache_enabled():   # (else the configured cache, shared with CI's compile check and later runs)
        monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(tmp_path))
        monkeypatch.delenv("AWQ_CUPY_DISABLE_CACHE")
    monkeypatch.setattr(jit, "_compiled", {})
    arch = jit.ARCHS["90"]
    generic, cases = {}, []
    for model in ("mistral-7b", "llama-2-70b"):
        for name, K, N in MODELS[model]:
            Kp, Np = padded_sizes(K, N)
            for dtype in ("float16", "bfloat16"):
                for M in (1, 16):
                    p = plans.plan_gemv(M, K, N, 128, arch=arch, dtype=dtype)
                    v = p.variant(dtype)
                    w = types.SimpleNamespace(N=N, K=K, KS=Kp // 64, group_size=128, NG=K // 128, NT=Np // 64)
                    extra = (("AWQ_GEMV_TRACE", "1"),) if (model, name, M) == ("mistral-7b", "o", 1) else ()
                    fam = kernels.gemv_shape_family(v, plans.gemv_shape_args(w, p), p.warps, extra,
                                                    tokens=plans.gemv_compiled_tokens(M, K, N))
                    cases.append((f"{model} {name} M={M} {dtype}", fam, v, p))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:   # NVRTC releases the GIL
        compiled = list(pool.map(lambda c: jit.compile_family(c[1], arch), cases))
    for (label, _, v, p), c in zip(cases, compiled):
        r = c.resources[v.expr]
        if v not in generic:
            generic[v] = jit.compile_family(kernels.GEMV_TC, arch).resources[v.expr]
        what = f"{label} {v.expr}: {r} (generic {generic[v]})"
        assert r.spill_stores == 0 and r.spill_loads == 0, what
        assert r.registers <= max(generic[v].registers, 65536 // (32 * p.warps)), what


def test_sass_loop_finds_the_tensor_core_loop():
    """tests/sass.py (the loop comparison before device time) picks the longest backward branch with at least
    8 tensor-core instructions, not a longer loop without them nor a forward branch, and compares schedules with
    registers and addresses erased."""
    sass_loop = _sass_loop()

    def sass(body_regs, extra=0):
        lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;"]
        addr = 0x10
        for i in range(30):        # a longer loop without HMMA
            lines.append(f"        /*{addr:04x}*/                   IADD3 R{i % 7}, R2, 0x1, RZ ;")
            addr += 0x10
        lines.append(f"        /*{addr:04x}*/               @P0 BRA 0x10 ;")
        addr += 0x10
        start = addr
        for i in range(9 + extra):
            lines.append(f"        /*{addr:04x}*/                   HMMA.16816.F32 R{body_regs + i}, R4, R8, R12 ;")
            addr += 0x10
        lines.append(f"        /*{addr:04x}*/               @P1 BRA 0x{addr + 0x20:x} ;")   # forward
        addr += 0x10
        lines.append(f"        /*{addr:04x}*/              @!P2 BRA 0x{start:x} ;")
        lines.append(f"        /*{addr + 0x10:04x}*/                   EXIT ;")
        return "\n".join(lines)

    loop = sass_loop.main_loop(sass_loop.instructions(sass(20)))
    assert len(loop) == 11 and sum("HMMA" in t for t in loop) == 9 and loop[-1] == "@!P2 BRA 0x200"
    renamed = sass_loop.main_loop(sass_loop.instructions(sass(40)))
    assert renamed != loop and [sass_loop.erase(t) for t in renamed] == [sass_loop.erase(t) for t in loop]
    longer = sass_loop.main_loop(sass_loop.instructions(sass(20, extra=1)))
    assert [sass_loop.erase(t) for t in longer] != [sass_loop.erase(t) for t in loop]
    assert [sass_loop.opcode(t) for t in loop][:2] == ["HMMA", "HMMA"]


def _ptx(family, arch_key, names):
    """PTX of ``names`` of ``family`` for ``arch_key`` (NVRTC on the CPU, the library's options without ptxas)."""
    from cupy.cuda import nvrtc

    arch = jit.ARCHS[arch_key]
    opts = [o for o in jit.compile_options(family, arch) if not o.startswith("--ptxas")]
    prog = nvrtc.createProgram(family.source_text(arch), f"{family.name}.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("family,arch_key,names", [
    (kernels.GEMV_TC, "90", ("awq_gemv_tc_kernel<__half, 1, 1, true>",
                             "awq_gemv_tc_kernel<__nv_bfloat16, 2, 3, false>")),
    (kernels.GEMM_TC, "90", ("awq_gemm_sw_kernel<__half, 2, 2, 5, true>",)),
    (kernels.GEMM_WG, "90a", ("awq_tile_x_kernel<__half>",)),
])
def test_activations_are_read_coherently_after_the_dependency_wait(family, arch_key, names):
    """x (written by the previous kernel, which with programmatic dependent launch may still be running) is read
    with coherent loads (common.cuh ld_act16 / ld_act4), never ld.global.nc: ptxas moved such loads above
    griddepcontrol.wait in a GEMV build (docs/history.md v28), and the chained-call GPU test then read stale x.
    In the PTX: no 16-byte non-coherent load (those are x's; weights stream with .cs, scales and zeros are 4-byte
    .nc), tile_x has no non-coherent load at all, and every coherent load comes after a griddepcontrol.wait."""
    ptx = _ptx(family, arch_key, names)
    entries = re.split(r"\n\.(?:visible|weak) \.entry ", ptx)[1:]
    assert len(entries) == len(names)
    for entry in entries:
        assert "griddepcontrol.wait" in entry
        assert not re.search(r"ld\.global\.nc\.v4", entry), "a 16-byte ld.global.nc (x through __ldg?)"
        if "tile_x" in entry.split("(")[0]:
            assert "ld.global.nc" not in entry
        first_wait = entry.index("griddepcontrol.wait")
        coherent = [m.start() for m in re.finditer(r"ld\.global(\.v4)?\.u32", entry)]
        assert coherent and min(coherent) > first_wait, "a coherent x load before griddepcontrol.wait"


def _sass_loop():
    """tests/sass.py (the SASS reader, also a command-line tool)."""
    import sass

    return sass


def test_no_instruction_writes_the_a_registers_of_a_wgmma_in_flight(compiled):
    """A wgmma with A from registers reads them until its group is retired (WARPGROUP.DEPBAR). Neither NVVM nor,
    across a loop's back edge, ptxas accounts for that: the v34 weights-as-B prototype got its next unit's
    ldmatrix into the registers of wgmmas still running, without a ptxas message, and gave wrong outputs
    whenever its producers ran ahead (docs/history.md v34). Every variant's SASS of the wgmma GEMM is checked for
    such writes (tests/sass.py wgmma_register_hazards, on `cuobjdump -sass` of the family's cubin)."""
    sass_loop = _sass_loop()
    c = compiled.families[("gemm_wg", "90a")]
    funcs = sass_loop.functions(sass_loop.cubin_sass(c.cubin))
    with_register_a = 0
    for variant, symbol in c.lowered.items():
        ins = funcs[symbol]
        assert ins, variant
        with_register_a += any(re.match(r"HGMMA\S* R\d+, R\d+,", t) for _, t in ins)
        assert sass_loop.wgmma_register_hazards(ins) == [], variant
    gemms = [v for v in c.lowered if "_gemm_" in v]   # gemm_wg also holds the x tile pass
    assert gemms and with_register_a == len(gemms), "every GEMM variant issues wgmmas with A from registers"


def test_wgmma_register_hazard_check_flags_a_planted_write():
    """The check itself: in a loop, an ldmatrix into the A registers of the group just committed is flagged, the
    same write after `WARPGROUP.DEPBAR.LE gsb0, 0x0` (or into other registers) is not, and SS wgmmas (A from a
    descriptor) have no A registers."""
    sass_loop = _sass_loop()

    def loop(*body):
        lines = [(0x100, "MOV R1, R2")]
        addr = 0x110
        for t in body:
            lines.append((addr, t))
            addr += 0x10
        lines.append((addr, "@!P0 BRA 0x110"))
        return lines

    hgmma = "HGMMA.64x64x16.F32 R24, R88, gdesc[UR8], R24, gsb0"
    hazard = loop("LDSM.16.M88.4 R88, [R10]", "WARPGROUP.ARRIVE", hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert sass_loop.wgmma_register_hazards(hazard) == ["0x0110 LDSM.16.M88.4 R88, [R10]"]
    retired = loop("LDSM.16.M88.4 R88, [R10]", "WARPGROUP.ARRIVE", hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert sass_loop.wgmma_register_hazards(retired) == []
    other = loop("LDSM.16.M88.4 R92, [R10]", "WARPGROUP.ARRIVE", hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert sass_loop.wgmma_register_hazards(other) == []
    partial = loop("HADD2 R91, R4, R5", "WARPGROUP.ARRIVE", hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert len(sass_loop.wgmma_register_hazards(partial)) == 1   # R91 is the fourth A register
    ss = loop("LDSM.16.M88.4 R88, [R10]", "HGMMA.64x64x16.F32 R24, gdesc[UR12], R24, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert sass_loop.wgmma_register_hazards(ss) == []
    # widths of the written registers, and instructions that write none
    for write, flagged in (("LDG.E.128 R86, desc[UR4][R2.64]", True), ("IMAD.WIDE R87, R3, 0x4, R4", True),
                           ("CS2R R90, SRZ", True), ("LDS.64 R86, [R3]", False), ("IMAD.WIDE R86, R3, 0x4, R4", False),
                           ("STS [R88], R4", False), ("ISETP.GE.AND P0, PT, R88, R3, PT", False),
                           ("@P0 MOV R89, R4", True), ("ATOM.E.ADD.STRONG.GPU R90, desc[UR4][R2.64], R5", True),
                           ("RED.E.ADD.STRONG.GPU desc[UR4][R88.64], R5", False)):
        body = loop(write, "WARPGROUP.ARRIVE", hgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
        assert bool(sass_loop.wgmma_register_hazards(body)) == flagged, write


# A ptxas message of that kind, as NVRTC 13.5 printed it for the (16, 2, 3) variant before its fragment buffers
# were kept live through their wgmmas' flight (awq_wg::retire, docs/history.md v35), checked against the pattern.
_C7513_FUNCTION = "_Z18awq_gemm_wg_kernelI6__halfLi16ELi2ELi3ELb1ELi3ELi1EEvPKT_PK5uint4PKjS8_S3_PS1_Pfiiiiiiiii"
_C7513 = ("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non "
          "wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage in the "
          f"function '{_C7513_FUNCTION}' in line 0")
_SERIALIZED = re.compile(r"\(C751\d\) Potential Performance Loss.*?function '(\S+)'")


def test_the_gemms_matmul_plans_are_not_serialized_by_ptxas(compiled):
    """ptxas serializes wgmmas it cannot overlap safely and says so ("Potential Performance Loss: wgmma.mma_async
    instructions are serialized", messages C7510-C7519), which makes every wgmma wait for the one before. None for
    the wgmma GEMM variants of the shapes matmul plans (kernels.GEMM_WG_DEFAULT, every dtype, PEND and K-stream
    count). The (16, 2, 3) variants, reached only with an explicit tiles=2, are not checked: NVRTC 12.9 and 13.0
    serialize them (C7513), 13.5 did too before awq_wg::retire and does not since (docs/history.md v35)."""
    assert _SERIALIZED.findall(_C7513) == [_C7513_FUNCTION]   # the pattern reads ptxas's message
    c = compiled.families[("gemm_wg", "90a")]
    serialized = set(_SERIALIZED.findall(c.log))
    defaults = set(kernels.GEMM_WG_DEFAULT.values())
    planned = [v.expr for v in kernels.GEMM_WG.variants(jit.ARCHS["90a"])
               if isinstance(v, kernels.WgmmaVariant) and (v.token_blocks, v.tiles, v.depth) in defaults]
    assert len(planned) >= 4 * len(defaults)   # two dtypes x aligned or not, at least
    assert [v for v in planned if c.lowered[v] in serialized] == []
