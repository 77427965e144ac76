"""The kernel runtime (awq_cupy.jit) on CPU: compile cache, cache keys, corrupted entries, threads, errors,
the ptxas report parser, the arch table, source inlining and launch-argument checks.

A tiny kernel family is compiled for real with NVRTC (no GPU needed) from a kernel folder in tmp_path, with the
disk cache in tmp_path and an empty in-memory cache per test.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from awq_cupy import jit
from awq_cupy import driver, settings

REPO = Path(__file__).resolve().parent.parent

HEADER = """\
// tiny common.cuh for the runtime tests
#pragma once
#include <cuda_fp16.h>
template <int SCALE> __device__ __forceinline__ float scaled(float v) { return SCALE * v; }
"""

TINY = """\
// tiny.cu: y[i] = SCALE * x[i]
#include "common.cuh"
template <int SCALE>
__global__ void tiny_kernel(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = scaled<SCALE>(x[i]);
}
"""

BROKEN = """\
#include "common.cuh"
template <int SCALE>
__global__ void tiny_kernel(float* y) { y[0] = undeclared_name * SCALE; }
"""

TINY_VARIANTS = ("tiny_kernel<1>", "tiny_kernel<2>")


def tiny_family(name="tiny", source="tiny.cu", defines=(), asserts=None):
    return jit.KernelFamily(name, source, lambda arch: TINY_VARIANTS, hot=True, defines=tuple(defines),
                            asserts=asserts)


class Env:
    """The test's kernel folder, cache folder and a counter of real NVRTC compiles."""

    def __init__(self, kernel_dir: Path, cache: Path):
        self.kernel_dir, self.cache = kernel_dir, cache
        self.compiles = 0
        self.delay = 0.0

    def entry(self, key: str) -> Path:
        return self.cache / key


@pytest.fixture
def env(tmp_path, monkeypatch):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "common.cuh").write_text(HEADER)
    (kdir / "tiny.cu").write_text(TINY)
    e = Env(kdir, tmp_path / "cache")
    monkeypatch.setattr(jit, "kernel_dir", lambda: kdir)
    monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(e.cache))
    monkeypatch.delenv("AWQ_CUPY_DISABLE_CACHE", raising=False)
    monkeypatch.setattr(jit, "_compiled", {})     # an empty memory cache; the real one is restored afterwards
    real = jit._nvrtc_compile

    def counting(*args, **kwargs):
        e.compiles += 1
        if e.delay:
            time.sleep(e.delay)
        return real(*args, **kwargs)

    monkeypatch.setattr(jit, "_nvrtc_compile", counting)
    return e


def forget_memory():
    """What a new process sees: nothing compiled in memory (the disk cache stays)."""
    jit._compiled.clear()


# ----------------------------------------------------------------------------------------------------------
# compile once, then memory, then disk
# ----------------------------------------------------------------------------------------------------------
def test_compiles_once_then_memory_then_disk(env):
    fam = tiny_family()
    c1 = jit.compile_family(fam, "90")
    assert env.compiles == 1
    assert not c1.from_cache
    assert c1.cubin.startswith(b"\x7fELF")
    assert sorted(c1.lowered) == sorted(TINY_VARIANTS)
    assert set(c1.resources) == set(TINY_VARIANTS), c1.log
    assert all(r.registers > 0 for r in c1.resources.values())

    assert jit.compile_family(fam, "90") is c1          # same process: the memory cache
    assert env.compiles == 1

    entry = env.entry(c1.key)
    assert sorted(p.name for p in entry.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == c1.key and meta["cubin_size"] == len(c1.cubin)
    assert "#include" not in (entry / "kernel.cu").read_text().replace("#include <cuda_fp16.h>", "")

    forget_memory()                                      # a "new process": read from disk, NVRTC not called
    c2 = jit.compile_family(fam, jit.ARCHS["90"])
    assert env.compiles == 1
    assert c2.from_cache
    assert c2 is not c1
    assert (c2.key, c2.cubin, c2.lowered, c2.resources) == (c1.key, c1.cubin, c1.lowered, c1.resources)
    assert jit.compile_family(fam, "90") is c2


# ----------------------------------------------------------------------------------------------------------
# what the cache key covers
# ----------------------------------------------------------------------------------------------------------
def _edit_header(env, monkeypatch):
    (env.kernel_dir / "common.cuh").write_text(HEADER + "// edited\n")
    return tiny_family(), "90"


def _edit_source(env, monkeypatch):
    (env.kernel_dir / "tiny.cu").write_text(TINY + "// edited\n")
    return tiny_family(), "90"


def _add_define(env, monkeypatch):
    return tiny_family(defines=(("AWQ_TEST_FLAG", "1"),)), "90"


def _other_arch(env, monkeypatch):
    return tiny_family(), "80"


def _other_nvrtc(env, monkeypatch):
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (99, 9))
    return tiny_family(), "90"


@pytest.mark.parametrize("change", [_edit_header, _edit_source, _add_define, _other_arch, _other_nvrtc],
                         ids=lambda f: f.__name__.strip("_"))
def test_key_changes_with(env, monkeypatch, change):
    base = jit.compile_family(tiny_family(), "90").key
    fam, arch = change(env, monkeypatch)
    forget_memory()
    c = jit.compile_family(fam, arch)
    assert c.key != base
    assert env.compiles == 2 and not c.from_cache, "a changed key must miss the cache and compile"
    assert env.entry(base).is_dir() and env.entry(c.key).is_dir()


def test_key_ignores_the_include_dir_but_not_other_options():
    fam, arch = tiny_family(), jit.ARCHS["90"]
    opts = ["-arch=sm_90", "--std=c++17", "-I/usr/local/cuda/include", "-DAWQ_CUPY_CC=900"]
    key = jit._family_key(fam, arch, TINY, opts, TINY_VARIANTS, (13, 0))
    moved = ["-I/opt/elsewhere/include" if o.startswith("-I") else o for o in opts]
    assert jit._family_key(fam, arch, TINY, moved, TINY_VARIANTS, (13, 0)) == key
    assert jit._family_key(fam, arch, TINY, opts + ["-DX=1"], TINY_VARIANTS, (13, 0)) != key
    assert jit._family_key(fam, arch, TINY, opts, TINY_VARIANTS[:1], (13, 0)) != key
    assert jit._family_key(fam, arch, TINY, opts, TINY_VARIANTS, (13, 1)) != key


def test_compile_options_carry_arch_and_defines():
    fam = tiny_family(defines=(("AWQ_TEST_FLAG", "3"),))
    opts = jit.compile_options(fam, jit.ARCHS["86"])
    assert "-arch=sm_86" in opts and "-DAWQ_CUPY_CC=860" in opts and "-DAWQ_TEST_FLAG=3" in opts
    assert "--ptxas-options=-v" in opts
    assert jit.compile_options(fam, jit.ARCHS["90a"])[0] == "-arch=sm_90a"


# ----------------------------------------------------------------------------------------------------------
# corrupted entries are misses, recompiled and rewritten
# ----------------------------------------------------------------------------------------------------------
def _truncate_cubin(d: Path):
    b = (d / "kernel.cubin").read_bytes()
    (d / "kernel.cubin").write_bytes(b[: len(b) // 2])


def _empty_cubin(d: Path):
    (d / "kernel.cubin").write_bytes(b"")


def _not_elf(d: Path):
    b = (d / "kernel.cubin").read_bytes()
    (d / "kernel.cubin").write_bytes(b"XXXX" + b[4:])


def _bad_json(d: Path):
    (d / "meta.json").write_text('{"key": "trunc')


def _wrong_key(d: Path):
    meta = json.loads((d / "meta.json").read_text())
    meta["key"] = "0" * len(meta["key"])
    (d / "meta.json").write_text(json.dumps(meta))


def _missing_resources(d: Path):
    meta = json.loads((d / "meta.json").read_text())
    del meta["resources"]
    (d / "meta.json").write_text(json.dumps(meta))


def _no_cubin(d: Path):
    (d / "kernel.cubin").unlink()


def _meta_not_a_dict(d: Path):
    (d / "meta.json").write_text("[]")


def _resources_a_list(d: Path):
    meta = json.loads((d / "meta.json").read_text())
    meta["resources"] = [1, 2]
    (d / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [_truncate_cubin, _empty_cubin, _not_elf, _bad_json, _wrong_key,
                                     _missing_resources, _no_cubin, _meta_not_a_dict, _resources_a_list], ids=lambda f: f.__name__.strip("_"))
def test_corrupted_entry_is_recompiled_and_rewritten(env, corrupt):
    fam = tiny_family()
    good = jit.compile_family(fam, "90")
    entry = env.entry(good.key)
    corrupt(entry)
    forget_memory()
    again = jit.compile_family(fam, "90")
    assert env.compiles == 2, "a corrupted entry must be a miss"
    assert not again.from_cache
    assert again.lowered == good.lowered
    meta = json.loads((entry / "meta.json").read_text())
    cubin = (entry / "kernel.cubin").read_bytes()
    assert meta["key"] == good.key and meta["cubin_size"] == len(cubin) and cubin.startswith(b"\x7fELF")
    forget_memory()
    assert jit.compile_family(fam, "90").from_cache     # the rewritten entry is good again
    assert env.compiles == 2


# ----------------------------------------------------------------------------------------------------------
# AWQ_CUPY_DISABLE_CACHE
# ----------------------------------------------------------------------------------------------------------
def test_disable_cache_writes_nothing(env, monkeypatch):
    monkeypatch.setenv("AWQ_CUPY_DISABLE_CACHE", "1")
    fam = tiny_family()
    c = jit.compile_family(fam, "90")
    assert not c.from_cache and c.cubin.startswith(b"\x7fELF")
    assert not env.cache.exists() or not any(env.cache.rglob("*")), sorted(env.cache.rglob("*"))
    forget_memory()
    jit.compile_family(fam, "90")
    assert env.compiles == 2


def test_disable_cache_does_not_read_existing_entries(env, monkeypatch):
    fam = tiny_family()
    c = jit.compile_family(fam, "90")
    mtime = (env.entry(c.key) / "meta.json").stat().st_mtime_ns
    monkeypatch.setenv("AWQ_CUPY_DISABLE_CACHE", "1")
    forget_memory()
    again = jit.compile_family(fam, "90")
    assert env.compiles == 2 and not again.from_cache
    assert (env.entry(c.key) / "meta.json").stat().st_mtime_ns == mtime


def test_unwritable_cache_dir_is_not_fatal(env, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(blocker / "cache"))
    c = jit.compile_family(tiny_family(), "90")
    assert c.cubin.startswith(b"\x7fELF") and env.compiles == 1


# ----------------------------------------------------------------------------------------------------------
# threads
# ----------------------------------------------------------------------------------------------------------
def test_concurrent_threads_compile_once(env):
    env.delay = 0.3                    # hold the compile open so that every thread arrives while it runs
    fam = tiny_family()
    n = 8
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = jit.compile_family(fam, "90")
        except BaseException as e:  # reported below, with the thread's index
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert env.compiles == 1
    assert all(r is results[0] for r in results)


# ----------------------------------------------------------------------------------------------------------
# compile errors
# ----------------------------------------------------------------------------------------------------------
def test_compile_error_carries_log_and_kept_source(env, monkeypatch, tmp_path):
    import tempfile

    kept = tmp_path / "kept"
    kept.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept))
    (env.kernel_dir / "broken.cu").write_text(BROKEN)
    fam = tiny_family(name="broken", source="broken.cu")
    with pytest.raises(jit.CompileError, match=r"'broken' for sm_80") as info:
        jit.compile_family(fam, "80")
    e = info.value
    assert e.family == "broken" and e.arch == "sm_80" and "-arch=sm_80" in e.options
    assert "undeclared_name" in e.log and "error" in e.log
    src = Path(e.source_path)
    assert src.parent == kept and src.suffix == ".cu"
    text = src.read_text()
    assert "undeclared_name" in text and "scaled" in text       # the inlined header is kept too
    assert e.log in str(e)
    assert not env.cache.exists() or not any(env.cache.rglob("meta.json"))
    assert not jit._compiled


def test_missing_source_names_the_file(env):
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        jit.compile_family(tiny_family(name="nope", source="nope.cu"), "90")


def test_family_not_supported_on_arch(env):
    fam = jit.KernelFamily("sm80_only", "tiny.cu", lambda arch: TINY_VARIANTS, needs=("mma_k16",))
    with pytest.raises(jit.UnsupportedArchError, match="sm80_only.*sm_75"):
        jit.compile_family(fam, "75")
    assert env.compiles == 0


# ----------------------------------------------------------------------------------------------------------
# ptxas report
# ----------------------------------------------------------------------------------------------------------
# Captured from cupy.cuda.nvrtc (NVRTC 13.5) compiling, for sm_80 with --ptxas-options=-v, a template kernel
# that holds 64 floats in registers under __launch_bounds__(1024, 2) (it spills), the same for 4 floats, and an
# extern "C" kernel with a 256-float __shared__ buffer. NVRTC ends the log with a NUL.
REAL_PTXAS_LOG = (
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function '_Z5heavyILi64EEvPKfPfi' for 'sm_80'\n"
    "ptxas info    : Function properties for _Z5heavyILi64EEvPKfPfi\n"
    "ptxas         .     688 bytes stack frame, 688 bytes spill stores, 1188 bytes spill loads\n"
    "ptxas info    : Used 32 registers, used 0 barriers, 688 bytes cumulative stack size, 372 bytes cmem[0]\n"
    "ptxas info    : Compile time = 24.764 ms\n"
    "ptxas info    : Compiling entry function '_Z5heavyILi4EEvPKfPfi' for 'sm_80'\n"
    "ptxas info    : Function properties for _Z5heavyILi4EEvPKfPfi\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 16 registers, used 0 barriers, 372 bytes cmem[0]\n"
    "ptxas info    : Compile time = 1.339 ms\n"
    "ptxas info    : Compiling entry function 'tile_copy' for 'sm_80'\n"
    "ptxas info    : Function properties for tile_copy\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 12 registers, used 1 barriers, 1024 bytes smem, 372 bytes cmem[0]\n"
    "ptxas info    : Compile time = 0.831 ms\n"
    "\x00"
)


def test_parse_ptxas_log_real_log():
    res = jit.parse_ptxas_log(REAL_PTXAS_LOG)
    assert res == {
        "_Z5heavyILi64EEvPKfPfi": jit.Resources(registers=32, spill_stores=688, spill_loads=1188,
                                                 stack_frame=688, static_smem=0),
        "_Z5heavyILi4EEvPKfPfi": jit.Resources(registers=16, spill_stores=0, spill_loads=0, stack_frame=0,
                                                static_smem=0),
        "tile_copy": jit.Resources(registers=12, spill_stores=0, spill_loads=0, stack_frame=0, static_smem=1024),
    }


def test_parse_ptxas_log_empty():
    assert jit.parse_ptxas_log("") == {}
    assert jit.parse_ptxas_log("ptxas info    : 0 bytes gmem\n") == {}


def test_resources_of_a_live_compile_match_lowered_names(env):
    c = jit.compile_family(tiny_family(), "86")
    parsed = jit.parse_ptxas_log(c.log)
    for variant, mangled in c.lowered.items():
        assert mangled.startswith("_Z") and mangled.encode() + b"\0" in c.cubin
        assert parsed[mangled] == c.resources[variant]
        assert c.resources[variant].spill_stores == 0 and c.resources[variant].static_smem == 0


# ----------------------------------------------------------------------------------------------------------
# arch table
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cc,key", [(75, "75"), (80, "80"), (86, "86"), (87, "86"), (89, "89"), (90, "90"),
                                    ("86", "86"), ("90", "90")])
def test_arch_for_cc(cc, key):
    a = jit.arch_for_cc(cc)
    assert a is jit.ARCHS[key]
    assert a.target == f"sm_{key}" and not a.arch_specific


def test_arch_for_cc_arch_specific():
    a = jit.arch_for_cc(90, arch_specific=True)
    assert a is jit.ARCHS["90a"] and a.target == "sm_90a" and a.arch_specific and a.cc == 90
    with pytest.raises(jit.UnsupportedArchError, match=r"sm_90a \(compute capability 9.0\) only, got 80"):
        jit.arch_for_cc(80, arch_specific=True)


@pytest.mark.parametrize("cc", [61, 70, 72, 100, 120])
def test_arch_for_cc_unsupported(cc):
    with pytest.raises(jit.UnsupportedArchError, match=f"compute capability {cc} is not supported") as info:
        jit.arch_for_cc(cc)
    for a in jit.ARCHS.values():
        assert f"sm_{a.key}" in str(info.value)


def test_arch_table():
    assert [a.target for a in jit.ARCHS.values()] == ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]
    assert not jit.ARCHS["75"].mma_k16 and all(jit.ARCHS[k].mma_k16 for k in ("80", "86", "89", "90", "90a"))
    hopper = [a.key for a in jit.ARCHS.values() if a.pdl]
    assert hopper == ["90", "90a"]
    for a in jit.ARCHS.values():   # the sm_90 features come together, and both 9.0 rows have the same ones
        assert a.wgmma == a.gemv_wide == a.gemv_shapes == a.gemv_scaled_16_warps == a.pdl, a.key
        assert a.gemv_mid_warps == (12 if a.mma_k16 else 8), a.key
    assert jit.ARCHS["90"].defines() == jit.ARCHS["90a"].defines()
    for a in jit.ARCHS.values():
        assert 48 * 1024 <= a.smem_optin <= 228 * 1024


# ----------------------------------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------------------------------
def test_read_source_inlines_our_headers_only(env):
    (env.kernel_dir / "outer.cuh").write_text('#pragma once\n#include "common.cuh"\n#define OUTER 1\n')
    (env.kernel_dir / "main.cu").write_text('#include <cuda_bf16.h>\n  #  include "outer.cuh"\nint main_body;\n')
    text = jit.read_source("main.cu")
    assert "#include <cuda_bf16.h>" in text
    assert "#include <cuda_fp16.h>" in text          # from common.cuh, left for NVRTC
    assert '#include "' not in text and "#  include" not in text
    assert "#define OUTER 1" in text and "scaled(float v)" in text and "int main_body;" in text
    assert text.index("// ---- begin outer.cuh") < text.index("// ---- begin common.cuh") < text.index("OUTER")


def test_read_source_include_cycle_terminates(env):
    (env.kernel_dir / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (env.kernel_dir / "b.cuh").write_text('#include "a.cuh"\nint b;\n')
    text = jit.read_source("a.cuh")
    assert text.count("int a;") == 1 and text.count("int b;") == 1
    assert "a.cuh already included" in text


def test_read_source_inlines_a_header_once_per_unit(env):
    """A header included by the source and again by another header is inlined once (the first time)."""
    (env.kernel_dir / "mid.cuh").write_text('#pragma once\n#include "common.cuh"\nint mid;\n')
    (env.kernel_dir / "unit.cu").write_text('#include "common.cuh"\n#include "mid.cuh"\nint body;\n')
    text = jit.read_source("unit.cu")
    assert text.count("// ---- begin common.cuh") == 2 and text.count("scaled(float v)") == 1
    assert "common.cuh already included" in text
    assert text.index("scaled(float v)") < text.index("int mid;") < text.index("int body;")


def test_a_family_outside_the_package_finds_its_own_and_the_library_headers(env, tmp_path):
    """``source_dir``: the family's folder first (its own headers win), then kernels_cu; it compiles like a
    shipped family, into the same cache."""
    own = tmp_path / "probes"
    own.mkdir()
    (own / "local.cuh").write_text("#define LOCAL_SCALE 2.0f\n")
    (own / "probe.cu").write_text('#include "common.cuh"\n#include "local.cuh"\nextern "C" __global__ void '
                                  'probe_kernel(float* y) { y[0] = scaled<1>(LOCAL_SCALE); }\n')
    text = jit.read_source("probe.cu", own)
    assert "float scaled(float v)" in text and "#define LOCAL_SCALE 2.0f" in text
    with pytest.raises(FileNotFoundError, match="probe.cu"):
        jit.read_source("probe.cu")                     # not in kernels_cu
    fam = jit.KernelFamily("probe", "probe.cu", lambda arch: ("probe_kernel",), hot=False, source_dir=str(own))
    c = jit.compile_family(fam, "86")
    assert list(c.lowered) == ["probe_kernel"] and env.compiles == 1


def test_family_asserts_are_compiled_with_the_source(env):
    """``asserts(arch)`` lines are appended to the source: a false one fails the compile, naming its message, and
    they are part of the cache key (the source text)."""
    ok = tiny_family(asserts=lambda arch: ("static_assert(sizeof(float) == 4, \"float is 4 bytes\");",))
    assert "static_assert(sizeof(float) == 4" in ok.source_text(jit.ARCHS["86"])
    jit.compile_family(ok, "86")
    bad = tiny_family(name="tiny_bad", asserts=lambda arch: ("static_assert(sizeof(float) == 8, \"table says 8\");",))
    with pytest.raises(jit.CompileError, match="table says 8"):
        jit.compile_family(bad, "86")


def test_arch_features_reach_the_source_as_defines():
    fam = tiny_family()
    for a in jit.ARCHS.values():
        opts = jit.compile_options(fam, a)
        assert f"-DAWQ_ARCH_MMA_K16={int(a.mma_k16)}" in opts and f"-DAWQ_ARCH_PDL={int(a.pdl)}" in opts
        assert f"-DAWQ_ARCH_GEMV_MID_WARPS={a.gemv_mid_warps}" in opts, opts


def test_read_source_missing_include(env):
    (env.kernel_dir / "bad.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        jit.read_source("bad.cu")


def test_real_sources_inline_completely():
    for path in sorted((REPO / "kernels_cu").iterdir()):
        text = jit.read_source(path.name)
        assert '#include "' not in text, path.name
        if path.suffix == ".cu":
            assert "// ---- begin common.cuh" in text, path.name


# ----------------------------------------------------------------------------------------------------------
# launch arguments
# ----------------------------------------------------------------------------------------------------------
class RecordingFunc:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


@pytest.mark.parametrize("bad", [3, 2.5, True])
def test_launch_rejects_python_scalars(bad):
    func = RecordingFunc()
    k = jit.Kernel("tiny_kernel<1>", "tiny", 0, func, None)
    with pytest.raises(TypeError, match=f"tiny_kernel<1>.*{type(bad).__name__}"):
        k.launch((1,), (32,), (np.uint64(0), bad))
    assert func.calls == []


def test_launch_passes_numpy_scalars():
    func = RecordingFunc()
    k = jit.Kernel("tiny_kernel<1>", "tiny", 0, func, None)
    args = (np.uint64(0), np.int32(7), np.float32(0.5))
    k.launch([2, 1], [64], args)
    assert func.calls == [((2, 1), (64,), args, 0)]


def test_as_i32():
    assert jit.as_i32(2**31 - 1) == 2**31 - 1 and isinstance(jit.as_i32(5), np.int32)
    with pytest.raises(ValueError, match="2147483648"):
        jit.as_i32(2**31)


# ----------------------------------------------------------------------------------------------------------
# import is free of side effects
# ----------------------------------------------------------------------------------------------------------
def test_import_does_not_import_cupy(tmp_path):
    code = ("import awq_cupy, awq_cupy.jit, awq_cupy.kernels, awq_cupy.cli, sys; "
            "assert 'cupy' not in sys.modules, sorted(m for m in sys.modules if 'cupy' in m)")
    env = dict(os.environ, AWQ_CUPY_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "cache").exists(), "import must not touch the compile cache"


def test_pdl_launch_structs_match_the_driver_api_layout():
    """cuLaunchKernelEx is called through ctypes: CUlaunchConfig (56 bytes: hStream at 32, attrs at 40, numAttrs at
    48) and CUlaunchAttribute (72 bytes: id, 4 bytes of padding, a 64-byte value union) as in cuda.h (CUDA 12+)."""
    import ctypes

    assert ctypes.sizeof(driver.LaunchConfig) == 56
    assert (driver.LaunchConfig.hStream.offset, driver.LaunchConfig.attrs.offset,
            driver.LaunchConfig.numAttrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(driver.LaunchAttribute) == 72 and driver.LaunchAttribute.value.offset == 8
    assert driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_pdl_kernel_arguments_fill_8_byte_slots_little_endian():
    """cuLaunchKernelEx reads each parameter's own width from its pointer: every argument gets an 8-byte slot
    holding its value in the low bytes (little-endian), so an int32 is read from the low half."""
    import ctypes

    import numpy as np

    slots = (ctypes.c_uint64 * 5)(*[driver.arg_bits(v) for v in (np.int32(-3), np.int64(1 << 40), np.uint64(0),
                                                                np.float32(0.5), np.int32(7))])
    base = ctypes.addressof(slots)
    assert ctypes.c_int32.from_address(base).value == -3
    assert ctypes.c_int64.from_address(base + 8).value == 1 << 40
    assert ctypes.c_uint64.from_address(base + 16).value == 0            # a null pointer argument
    assert ctypes.c_float.from_address(base + 24).value == 0.5
    assert ctypes.c_int32.from_address(base + 32).value == 7
    with pytest.raises(TypeError, match="float64"):
        driver.arg_bits(np.float64(1.0))
    with pytest.raises(TypeError, match="not a device array"):
        driver.arg_bits([1, 2])

    class FakeArray:        # anything with .data.ptr (a CuPy array) goes by pointer
        class data:
            ptr = 0x1000

    assert driver.arg_bits(FakeArray()) == 0x1000


def test_pdl_only_on_compute_capability_9(monkeypatch):
    from awq_cupy.plans import uses_pdl

    assert uses_pdl(jit.ARCHS["90"]) and uses_pdl(jit.ARCHS["90a"])
    assert not any(uses_pdl(jit.ARCHS[k]) for k in ("75", "80", "86", "89"))
    monkeypatch.setenv("AWQ_CUPY_PDL", "0")
    settings.reload()
    assert not uses_pdl(jit.ARCHS["90"])


def test_launch_attributes_have_the_driver_layout():
    """cuLaunchKernelEx attributes: 4-byte id, padding, a 64-byte value union (CUDA 12+ driver headers); PDL is
    id 6 with value 1, a cluster shape id 4 with three unsigned ints."""
    import ctypes
    import struct

    assert ctypes.sizeof(driver.LaunchAttribute) == 72 and driver.LaunchAttribute.value.offset == 8

    def value(a, fmt):   # the union's first bytes (a c_char array's .value stops at the first zero byte)
        return struct.unpack(fmt, ctypes.string_at(ctypes.addressof(a) + 8, struct.calcsize(fmt)))

    arr, n = driver.launch_attributes(True, None)
    assert n == 1 and arr[0].id == 6 and value(arr[0], "<i") == (1,)
    arr, n = driver.launch_attributes(False, (1, 4))
    assert n == 1 and arr[0].id == 4 and value(arr[0], "<3I") == (1, 4, 1)
    arr, n = driver.launch_attributes(True, (1, 8, 1))
    assert n == 2 and [a.id for a in arr] == [6, 4] and value(arr[1], "<3I") == (1, 8, 1)
    assert driver.launch_attributes(True, (1, 8, 1))[0] is arr   # built once per set


# ----------------------------------------------------------------------------------------------------------
# User programs: compile_source / compile_file with the library's headers (docs/kernel-api.md)
# ----------------------------------------------------------------------------------------------------------
USER = """\
// user.cu: decode one tile word per thread with the library's accessors
#include "awq_cupy.cuh"
template <typename T>
__global__ void codes(const uint4* __restrict__ qtiles, int KS, u32* out) {
  const uint4 w = awq_load_tile(qtiles, KS, blockIdx.x, 0, threadIdx.x);
  out[threadIdx.x] = awq_code(w.x, 3) + awq_tile_k(1, threadIdx.x & 3);
}
"""
PLAIN = """\
extern "C" __global__ void plain(float* y, int n) { if (threadIdx.x < n) y[threadIdx.x] = SCALE; }
"""


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """A fresh disk cache and memory cache; NVRTC compiles counted."""
    monkeypatch.setenv("AWQ_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AWQ_CUPY_DISABLE_CACHE", raising=False)
    monkeypatch.setattr(jit, "_compiled", {})
    counter = {"n": 0}
    real = jit._nvrtc_compile

    def counting(*args, **kwargs):
        counter["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(jit, "_nvrtc_compile", counting)
    return counter


@pytest.mark.parametrize("arch", list(jit.ARCHS))
def test_user_source_with_the_library_header_compiles_for_every_arch(user_cache, arch):
    prog = jit.compile_source(USER, ["codes<__half>"], arch=arch, filename="user.cu")
    assert prog.arch is jit.ARCHS[arch] and prog.names == ("codes<__half>",)
    r = prog.resources["codes<__half>"]
    assert r.registers > 0 and r.spill_stores == r.spill_loads == 0
    assert prog.lowered["codes<__half>"].startswith("_Z") and prog.cubin.startswith(b"\x7fELF")
    assert "codes<__half>" in prog.report() and jit.ARCHS[arch].target in prog.report()


@pytest.mark.parametrize("arch", ["75", "90a"])
def test_user_source_without_library_headers(user_cache, arch):
    prog = jit.compile_source(PLAIN, "plain", arch=arch, defines={"SCALE": "2.5f"})
    assert prog.lowered["plain"] == "plain" and prog.resources["plain"].registers > 0
    with pytest.raises(jit.CompileError, match="SCALE"):       # the define is what made it compile
        jit.compile_source(PLAIN, "plain", arch=arch)


def test_user_program_cache_hit_and_miss_when_an_included_header_changes(user_cache, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "mine.cuh").write_text("#pragma once\n__device__ float twice(float v) { return 2 * v; }\n")
    src = '#include "mine.cuh"\nextern "C" __global__ void k(float* y) { y[0] = twice(y[0]); }\n'
    a = jit.compile_source(src, "k", arch="86", include_dirs=[inc])
    assert user_cache["n"] == 1 and not a.from_cache
    jit._compiled.clear()                                           # a new process: the disk cache answers
    b = jit.compile_source(src, "k", arch="86", include_dirs=[inc])
    assert user_cache["n"] == 1 and b.from_cache and b.compiled.key == a.compiled.key
    (inc / "mine.cuh").write_text("#pragma once\n__device__ float twice(float v) { return v + v; }\n")
    c = jit.compile_source(src, "k", arch="86", include_dirs=[inc])
    assert user_cache["n"] == 2 and c.compiled.key != a.compiled.key


def test_user_compile_error_names_the_users_file_and_line(user_cache, tmp_path):
    f = tmp_path / "broken_kernel.cu"
    f.write_text('#include "awq_cupy.cuh"\n\n__global__ void k(float* y) {\n  y[0] = not_declared;\n}\n')
    with pytest.raises(jit.CompileError) as e:
        jit.compile_file(f, "k", arch="90")
    assert 'broken_kernel.cu(4): error: identifier "not_declared" is undefined' in e.value.log, e.value.log
    assert "broken_kernel.cu(4)" in str(e.value)


def test_compile_file_finds_headers_beside_the_file_first(user_cache, tmp_path):
    (tmp_path / "common.cuh").write_text("#pragma once\n#define FROM_BESIDE 1\n")   # shadows the library's
    f = tmp_path / "k.cu"
    f.write_text('#include "common.cuh"\n#if !FROM_BESIDE\n#error wrong header\n#endif\n'
                 'extern "C" __global__ void k() {}\n')
    assert jit.compile_file(f, "k", arch="80").names == ("k",)


def test_user_api_rejects_bad_input(user_cache, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="at least one kernel"):
        jit.compile_source(PLAIN, [], arch="80")
    with pytest.raises(TypeError, match="source text"):
        jit.compile_source(b"x", "k", arch="80")
    with pytest.raises(ValueError, match="unknown arch 'sm_61'"):
        jit.compile_source(PLAIN, "plain", arch="sm_61")
    with pytest.raises(ValueError, match="not a C identifier"):
        jit.compile_source(PLAIN, "plain", arch="80", defines={"1x": "2"})
    with pytest.raises(ValueError, match="cannot read kernel source"):
        jit.compile_file(tmp_path / "missing.cu", "k", arch="80")
    assert jit.resolve_arch("sm_90a") is jit.ARCHS["90a"]
    from awq_cupy import _array

    monkeypatch.setattr(_array, "_GPU_AVAILABLE", False)
    with pytest.raises(ValueError, match="Name the target"):
        jit.compile_source(PLAIN, "plain", defines={"SCALE": "1.f"})
    prog = jit.compile_source(PLAIN, "plain", arch="80", defines={"SCALE": "1.f"})
    with pytest.raises(_array.GPUUnavailableError, match="Program.kernel needs a CUDA GPU"):
        prog.kernel()


def test_include_lines_keep_line_numbers(tmp_path):
    (tmp_path / "h.cuh").write_text("// one\n// two\n")
    text = jit.inline_includes('// a\n#include "h.cuh"  // why\n// c\n', "main.cu", [tmp_path])
    lines = text.splitlines()
    assert '#line 1 "h.cuh"' in lines and lines[-2:] == ['#line 3 "main.cu"', "// c"]


def test_cli_compiles_a_users_file(tmp_path):
    f = tmp_path / "mine.cu"
    f.write_text(USER)
    env = dict(os.environ, AWQ_CUPY_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "awq_cupy", "compile", "--source", str(f), "--name", "codes<__half>",
                        "--arch", "80,90a"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "kernel (sm_80)" in r.stdout and "kernel (sm_90a)" in r.stdout and r.stdout.count("codes<__half>") == 2
    bad = subprocess.run([sys.executable, "-m", "awq_cupy", "compile", "--source", str(f), "--arch", "80"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "needs at least one --name" in bad.stderr


LAYOUT_PROBE = """\
// Reads every code, zero and scale of a QuantizedWeight through awq_cupy.cuh and writes them out densely.
#include "awq_cupy.cuh"
__global__ void layout_probe(const uint4* __restrict__ qtiles, const unsigned short* __restrict__ scales,
                             const unsigned short* __restrict__ zeros, int K, int N, int KS, int Np, int G, int NG,
                             unsigned char* q, unsigned char* z, unsigned short* s) {
  pdl_wait();
  const int t = blockIdx.x, ks = blockIdx.y, lane = threadIdx.x, r = lane & 3, c = lane >> 2;
  const uint4 wv = awq_load_tile(qtiles, KS, t, ks, lane);
  const u32 words[4] = {wv.x, wv.y, wv.z, wv.w};
  for (int i = 0; i < 4; ++i) {
    const int g = awq_group(64 * ks + 32 * (i >> 1), G, NG);
    const u32 zp = awq_load_pair(zeros, Np, g, t, c), sp = awq_load_pair(scales, Np, g, t, c);
    for (int v = 0; v < 8; ++v) {
      const int k = 64 * ks + awq_tile_k(i, r) + 2 * ((v >> 1) & 1) + (v & 1), n = 16 * t + c + 8 * (v >> 2);
      q[(long long)k * Np + n] = (unsigned char)awq_code(words[i], v);
      z[(long long)g * Np + n] = (unsigned char)((zp >> (16 * (v >> 2))) & 0xF);
      s[(long long)g * Np + n] = (unsigned short)(sp >> (16 * (v >> 2)));
    }
  }
  pdl_trigger();
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_user_kernel_reads_the_weight_layout_with_pdl_and_in_a_graph(dtype):
    """The header's contract on the GPU: a user kernel decodes exactly the codes, zeros and scales that were
    packed (awkward K, N and G), launched plainly, with PDL right after a matmul, and replayed in a CUDA graph."""
    import cupy as cp

    import awq_cupy
    from awq_cupy import formats, layout

    rng = np.random.default_rng(1)
    K, N, G = 320, 72, 64
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (K // G, N), dtype=np.uint8)
    S = rng.uniform(0.01, 0.02, (K // G, N)).astype(np.float16)
    t = formats.pack(Q, Z, S, "gemm", G)
    w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=dtype)
    L = w.layout()
    assert (L.K, L.N, L.Kp, L.Np, L.KS, L.NT16, L.NG, L.group_size) == (K, N, 320, 128, 5, 8, 5, 64)
    assert L.block_stride == 5 * 32 and L.qtiles is w.qtiles and L.dtype == dtype and L.device == w.device
    k = jit.compile_source(LAYOUT_PROBE, "layout_probe", arch=jit.arch_of_device()).kernel()
    bufs = [cp.zeros((L.Kp, L.Np), cp.uint8), cp.zeros((L.NG, L.Np), cp.uint8), cp.zeros((L.NG, L.Np), cp.uint16)]

    def check(what):
        q, z, s = (b.get() for b in bufs)
        assert np.array_equal(q[:K, :N], Q) and not q[K:].any() and not q[:, N:].any(), what
        assert np.array_equal(z[:, :N], Z), what
        want = layout.float_bits(S.astype(np.float32), dtype)
        assert np.array_equal(s[:, :N], want), what

    k.launch((L.NT16, L.KS), (32,), L.args() + tuple(bufs))
    check("plain launch")
    for b in bufs:
        b[...] = 0
    x = cp.asarray(rng.standard_normal((1, K)).astype(np.float32)).astype(w._xdtype)
    awq_cupy.matmul(x, w)
    k.launch((L.NT16, L.KS), (32,), L.args() + tuple(bufs), pdl=jit.arch_of_device().pdl)
    check("PDL launch after a matmul")

    def step():
        awq_cupy.matmul(x, w)
        k.launch((L.NT16, L.KS), (32,), L.args() + tuple(bufs), pdl=jit.arch_of_device().pdl)
        return bufs[0]

    graph = awq_cupy.capture(step)
    for b in bufs:
        b[...] = 0
    graph()
    cp.cuda.get_current_stream().synchronize()
    check("graph replay")
