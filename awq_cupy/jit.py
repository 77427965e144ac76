"""The kernel runtime: ``kernels_cu/*.cu`` -> NVRTC -> cubin -> disk/memory cache -> loaded CUDA functions.

Data path::

    ARCHS (cc -> Arch)  x  KernelFamily (source file + name expressions per arch)
        -> source with our own headers inlined
        -> cupy.cuda.nvrtc (our options, our -arch; CuPy's own compile would append its own -arch)
        -> cubin + lowered names + ptxas resource report
        -> disk cache  $AWQ_CUPY_CACHE_DIR or ~/.cache/awq_cupy/<sha256>/{kernel.cubin, meta.json}
        -> memory cache (bytes per key; loaded modules per (device, key))
        -> Kernel.launch(...) on the caller's current CuPy stream

Compiling needs only NVRTC (no GPU): ``compile_family`` / ``compile_all`` run on CPU-only machines and CI.
Loading and launching need a GPU. Nothing here runs at import time.

Environment variables:
  AWQ_CUPY_CACHE_DIR      cache folder (default ~/.cache/awq_cupy)
  AWQ_CUPY_DISABLE_CACHE  "1": never read or write the disk cache
  AWQ_CUPY_JIT_DEBUG      "1": print each compile (family, arch, options, time) to stderr
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = [
    "Arch", "ARCHS", "KernelFamily", "Resources", "CompiledFamily", "Kernel", "CompileError",
    "UnsupportedArchError", "arch_for_cc", "arch_of_device", "compile_family", "get_kernel", "read_source",
    "cache_dir", "kernel_dir", "variant_expr", "inline_includes", "resolve_arch", "Program", "compile_source",
    "compile_file",
]

# Bump when the cache layout or key recipe changes: old entries are then simply never looked up again.
_KEY_FORMAT = 1


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source. Carries the evidence; the failing source is written to ``source_path``."""

    def __init__(self, family: str, arch: str, options: list[str], log: str, source_path: str):
        self.family, self.arch, self.options, self.log, self.source_path = family, arch, options, log, source_path
        super().__init__(f"NVRTC failed to compile kernel family {family!r} for {arch} "
                         f"(options {options}); source kept at {source_path}\n{log}")


class UnsupportedArchError(RuntimeError):
    """The device's compute capability is not one awq_cupy builds for."""


# --------------------------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """One compile target and what its hardware offers the kernels, as named features.

    The features are the one place that decides what runs where: the Python planners read them, and
    ``compile_options`` passes each to the kernel sources as an ``AWQ_ARCH_<NAME>`` define, so the C++ tests the
    same flag instead of comparing compute capabilities. ``cc`` is the compute capability as an int (90 for both
    sm_90 and sm_90a); nothing outside this table compares it. Adding an architecture is one row here
    (docs/design.md §Adding a variant or an architecture).
    """

    key: str            # "75", ..., "90", "90a": what --arch on the CLI takes
    cc: int             # 75, 80, 86, 89, 90
    target: str         # NVRTC -arch value
    smem_optin: int     # max dynamic shared memory per block after opting in (bytes)
    # m16n8k16 mma.sync with f16 and bf16 operands, cp.async and ldmatrix.trans: the bf16 kernels and the
    # cp.async pipelines (sm_80 on)
    mma_k16: bool = False
    # programmatic dependent launch (griddepcontrol): every kernel triggers its successor early and waits for
    # its predecessor before touching x (sm_90 on)
    pdl: bool = False
    # the device runs the warpgroup-MMA GEMM (kernels compiled for the arch-specific sm_90a target)
    wgmma: bool = False
    # the GEMV's three- and four-token-block variants for 17..32 rows, and the GEMV compiled per launch shape:
    # both measured faster only on the H200, so enabled on 9.0 only
    gemv_wide: bool = False
    gemv_shapes: bool = False
    # warps per CTA of the GEMV's middle units (4..7 blocks x token blocks): 12 fit the registers where the
    # cp.async pipeline frees them, 8 without it
    gemv_mid_warps: int = 8
    # the scaled pair variant (two token blocks x two tiles) runs 16 warps: its decode needs fewer registers on
    # sm_90's code generation (measured there only)
    gemv_scaled_16_warps: bool = False

    @property
    def arch_specific(self) -> bool:  # sm_90a: wgmma/setmaxnreg; cubins run on cc 9.0 only
        return self.target.endswith("a")

    def defines(self) -> tuple[tuple[str, str], ...]:
        """The features as the kernel sources see them (``AWQ_ARCH_MMA_K16`` = 1, ...)."""
        return tuple((f"AWQ_ARCH_{f.name.upper()}", str(int(getattr(self, f.name))))
                     for f in dataclasses.fields(self) if f.name in _FEATURES)


_FEATURES = ("mma_k16", "pdl", "wgmma", "gemv_wide", "gemv_shapes", "gemv_mid_warps", "gemv_scaled_16_warps")

_AMPERE = dict(mma_k16=True, gemv_mid_warps=12)
_HOPPER = dict(_AMPERE, pdl=True, wgmma=True, gemv_wide=True, gemv_shapes=True, gemv_scaled_16_warps=True)

# Opt-in shared memory per block from the CUDA programming guide's compute-capability table.
ARCHS: dict[str, Arch] = {a.key: a for a in (
    Arch("75", 75, "sm_75", 65536),
    Arch("80", 80, "sm_80", 166912, **_AMPERE),
    Arch("86", 86, "sm_86", 101376, **_AMPERE),
    Arch("89", 89, "sm_89", 101376, **_AMPERE),
    Arch("90", 90, "sm_90", 232448, **_HOPPER),
    Arch("90a", 90, "sm_90a", 232448, **_HOPPER),
)}


def arch_for_cc(cc: int | str, *, arch_specific: bool = False) -> Arch:
    """The compile target for a device of compute capability ``cc`` (e.g. 90 or "90").

    Devices between table rows run the nearest lower target of the same major version (sm_87 runs sm_86 code).
    Anything else raises UnsupportedArchError naming what is supported.
    """
    cc = int(cc)
    if arch_specific:
        specific = [a for a in ARCHS.values() if a.arch_specific and a.cc == cc]
        if not specific:
            targets = ", ".join(f"{a.target} (compute capability {a.cc / 10:.1f})"
                                for a in ARCHS.values() if a.arch_specific)
            raise UnsupportedArchError(f"arch-specific kernels are built for {targets} only, got {cc}")
        return specific[0]
    same_major = [a for a in ARCHS.values() if not a.arch_specific and a.cc // 10 == cc // 10 and a.cc <= cc]
    if not same_major:
        supported = ", ".join(f"sm_{a.key}" for a in ARCHS.values())
        raise UnsupportedArchError(f"compute capability {cc} is not supported; awq_cupy builds for {supported}")
    return max(same_major, key=lambda a: a.cc)


_device_cc: dict[int, str] = {}


def arch_of_device(device_id: int | None = None, *, arch_specific: bool = False) -> Arch:
    """The compile target of a CUDA device (the current one by default); the capability is cached per device."""
    import cupy

    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    cc = _device_cc.get(device_id)
    if cc is None:
        cc = _device_cc[device_id] = cupy.cuda.Device(device_id).compute_capability
    return arch_for_cc(cc, arch_specific=arch_specific)


# --------------------------------------------------------------------------------------------------------------
# Kernel families and their sources
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelFamily:
    """One ``.cu`` source file and the template instantiations it is compiled with.

    ``variants(arch)`` returns what to instantiate for that arch: C++ name expressions, or variant objects with
    an ``expr`` attribute that renders one (the shipped families: ``awq_cupy.kernels``). ``hot`` kernels must not
    spill; ``needs`` names the ``Arch`` features the family requires (``("wgmma",)``); ``arch_specific`` families
    compile for the ``sm_90a``-style targets only. ``source_dir`` is the folder of ``source`` (default: the
    package's ``kernels_cu``); its ``#include "x.cuh"`` lines are looked up there first, then in ``kernels_cu``,
    so a family outside the package can use the library's device helpers. ``defines`` are extra ``-D`` options.
    """

    name: str
    source: str
    variants: Callable[[Arch], tuple]
    hot: bool = True
    needs: tuple[str, ...] = ()
    arch_specific: bool = False
    defines: tuple[tuple[str, str], ...] = ()
    source_dir: str | None = None
    asserts: Callable[[Arch], tuple[str, ...]] | None = None
    # user programs (compile_source): the source text itself (then ``source`` is only its file name in
    # messages), more folders for its #include "..." lines, and NVRTC options of its own
    text: str | None = None
    include_dirs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def source_text(self, arch: Arch) -> str:
        """What NVRTC compiles for ``arch``: the source with its headers inlined, then the ``asserts(arch)`` lines
        (C++ static_asserts checking the Python tables against the kernels)."""
        dirs = ((self.source_dir,) if self.source_dir is not None else ()) + tuple(self.include_dirs)
        text = inline_includes(self.text, self.source, dirs) if self.text is not None else \
            read_source(self.source, dirs)
        if self.asserts is not None:
            text += "\n// ---- checks of the Python kernel table\n" + "\n".join(self.asserts(arch)) + "\n"
        return text

    def supports(self, arch: Arch) -> bool:
        return arch.arch_specific == self.arch_specific and all(getattr(arch, f) for f in self.needs)

    def names(self, arch: Arch) -> tuple[str, ...]:
        """The C++ name expressions of ``variants(arch)``."""
        return tuple(variant_expr(v) for v in self.variants(arch))


def variant_expr(variant) -> str:
    """The C++ name expression of a variant: the string itself, or a variant object's ``expr``."""
    return variant if isinstance(variant, str) else variant.expr


# one line (a trailing // comment allowed), so the #line directives count right
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*(?://.*)?$', re.M)


def kernel_dir():
    """Where the library's .cu sources are: the installed package data, or kernels_cu/ of a source tree."""
    try:
        from importlib.resources import files

        d = files("awq_cupy.kernels_cu")
        if d.joinpath("common.cuh").is_file():
            return d
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent / "kernels_cu"


def _search_dirs(source_dir) -> list:
    if source_dir is None:
        extra = []
    elif isinstance(source_dir, (str, os.PathLike)):
        extra = [Path(source_dir)]
    else:
        extra = [Path(d) for d in source_dir]
    return extra + [kernel_dir()]


def read_source(name: str, source_dir=None, _seen: set | None = None) -> str:
    """Text of ``<source_dir or kernels_cu>/<name>`` with our own ``#include "x.cuh"`` lines inlined
    (recursively, once each per translation unit, like ``#pragma once``; looked up in ``source_dir`` (a folder or
    a list of folders) first, then ``kernels_cu``), so that the cache key covers every header by content.
    ``#line`` directives keep NVRTC's messages and the line info pointing at each file's own lines."""
    seen = set() if _seen is None else _seen
    if name in seen:
        return f"// {name} already included\n"
    dirs = _search_dirs(source_dir)
    for d in dirs:
        path = d.joinpath(name)
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            break
    else:
        raise FileNotFoundError(f"kernel source {name!r} not found in {', '.join(map(str, dirs))}")
    return inline_includes(text, name, source_dir, seen)


def inline_includes(text: str, name: str, source_dir=None, _seen: set | None = None) -> str:
    """``text`` (the file ``name``) with its ``#include "x.cuh"`` lines replaced by the headers' text, found in
    ``source_dir`` (a folder or a list) and then ``kernels_cu``; system includes (``<...>``) stay for NVRTC."""
    seen = set() if _seen is None else _seen
    seen.add(name)

    def inline(m: re.Match) -> str:
        header = m.group(1)
        after = text.count("\n", 0, m.start()) + 2        # the line after the #include, 1-based
        return (f"// ---- begin {header}\n#line 1 \"{header}\"\n{read_source(header, source_dir, seen)}"
                f"\n// ---- end {header}\n#line {after} \"{name}\"")

    return _INCLUDE_RE.sub(inline, text)


def _cuda_include_dir() -> str:
    """Folder with cuda_fp16.h / cuda_bf16.h (from the nvidia-cuda-runtime wheel, or a CUDA toolkit)."""
    candidates = []
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            candidates.append(d)
    except Exception:  # pathfinder missing or not finding the wheel: try the toolkit locations below
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    candidates += ["/usr/local/cuda/include"]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            return d
    raise RuntimeError("cuda_fp16.h not found: install the CUDA headers with `pip install awq_cupy[cuda13]` "
                       "(nvidia-cuda-runtime) or set CUDA_PATH to a CUDA toolkit")


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


# --------------------------------------------------------------------------------------------------------------
# Compile
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    """ptxas's report for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int


@dataclass(frozen=True)
class CompiledFamily:
    key: str
    family: str
    arch: str
    cubin: bytes
    lowered: dict          # name expression -> mangled symbol
    resources: dict        # name expression -> Resources
    log: str
    seconds: float
    from_cache: bool = False


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Per mangled kernel name: registers, spills, stack frame and static shared memory from ``ptxas -v``."""
    out: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        m = _PTXAS_FUNC.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        if current is None:
            continue
        m = _PTXAS_STACK.search(line)
        if m:
            out[current].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            smem = re.search(r"(\d+) bytes smem", line)
            out[current].update(registers=int(m.group(1)), static_smem=int(smem.group(1)) if smem else 0)
    res = {}
    for name, d in out.items():
        if "registers" in d:
            res[name] = Resources(d["registers"], d.get("spill_stores", 0), d.get("spill_loads", 0),
                                  d.get("stack_frame", 0), d.get("static_smem", 0))
    return res


def compile_options(family: KernelFamily, arch: Arch) -> list[str]:
    """Every NVRTC option for (family, arch): the one place that maps an arch to compile flags."""
    # -default-device: unannotated functions (and generic lambdas) are device code; NVRTC 13.0 rejects them
    # otherwise, while 13.5 accepts them.
    opts = [f"-arch={arch.target}", "--std=c++17", "-default-device", f"-I{_cuda_include_dir()}",
            f"-DAWQ_CUPY_CC={arch.cc * 10}", "--ptxas-options=-v", "-lineinfo"]
    opts += [f"-D{k}={v}" for k, v in arch.defines() + family.defines]
    return opts + list(family.options)


def cache_dir() -> Path:
    return Path(os.environ.get("AWQ_CUPY_CACHE_DIR") or Path.home() / ".cache" / "awq_cupy")


def _cache_enabled() -> bool:
    return os.environ.get("AWQ_CUPY_DISABLE_CACHE", "") not in ("1", "true", "yes")


def _debug(msg: str) -> None:
    if os.environ.get("AWQ_CUPY_JIT_DEBUG", "") in ("1", "true", "yes"):
        print(f"[awq_cupy.jit] {msg}", file=sys.stderr)


def _family_key(family: KernelFamily, arch: Arch, source: str, options: list[str], names: tuple[str, ...],
                nvrtc_ver: tuple[int, int]) -> str:
    # The include dir is machine-specific and does not change the code: leave it out so caches can be shared.
    stable_opts = [o for o in options if not o.startswith("-I")]
    blob = json.dumps(dict(fmt=_KEY_FORMAT, family=family.name, source=source, options=stable_opts,
                           arch=arch.target, names=list(names), nvrtc=list(nvrtc_ver)), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read_cached(key: str) -> CompiledFamily | None:
    d = cache_dir() / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        cubin = (d / "kernel.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    # A corrupted or foreign entry is a miss, never an error: it is recompiled and overwritten.
    if meta.get("key") != key or not cubin.startswith(b"\x7fELF") or len(cubin) != meta.get("cubin_size"):
        return None
    try:
        resources = {k: Resources(**v) for k, v in meta["resources"].items()}
        return CompiledFamily(key, meta["family"], meta["arch"], cubin, dict(meta["lowered"]), resources,
                              meta.get("log", ""), float(meta.get("seconds", 0.0)), from_cache=True)
    except (KeyError, TypeError, AttributeError, ValueError):
        return None


def _write_cached(c: CompiledFamily, source: str, options: list[str]) -> None:
    d = cache_dir() / c.key
    try:
        d.mkdir(parents=True, exist_ok=True)
        meta = dict(key=c.key, family=c.family, arch=c.arch, lowered=c.lowered, options=options,
                    resources={k: dataclasses.asdict(v) for k, v in c.resources.items()}, log=c.log,
                    seconds=c.seconds, cubin_size=len(c.cubin), nvrtc=list(nvrtc_version()))
        # Publish atomically: write temp files in the same folder, then os.replace (cubin first, meta last,
        # so a reader that sees meta.json also sees a complete cubin).
        for name, data in (("kernel.cu", source.encode()), ("kernel.cubin", c.cubin),
                           ("meta.json", json.dumps(meta, indent=1).encode())):
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, d / name)
    except OSError as e:  # a read-only home must not break the library
        _debug(f"cannot write cache entry {d}: {e}")


_compiled: dict[str, CompiledFamily] = {}
_key_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def _nvrtc_compile(family: KernelFamily, arch: Arch, source: str, options: list[str],
                   names: tuple[str, ...]) -> tuple[bytes, dict, str]:
    from cupy.cuda import nvrtc

    filename = family.source if family.text is not None else f"{family.name}.cu"
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            fd, path = tempfile.mkstemp(prefix=f"awq_cupy_{family.name}_{arch.key}_", suffix=".cu")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            raise CompileError(family.name, arch.target, options, log, path) from None
        log = nvrtc.getProgramLog(prog)
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
        # CuPy's getCUBIN drops the ELF image's final byte (docs/gpu-notes.md §Cubin images); restore the NUL.
        cubin = nvrtc.getCUBIN(prog) + b"\0"
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, lowered, log


def compile_family(family: KernelFamily, arch: Arch | str) -> CompiledFamily:
    """Compile (or fetch from cache) every variant of ``family`` for ``arch``. Needs no GPU. Thread-safe:
    concurrent callers of the same key compile once."""
    arch = ARCHS[arch] if isinstance(arch, str) else arch
    if not family.supports(arch):
        raise UnsupportedArchError(f"kernel family {family.name!r} does not run on {arch.target}")
    names = family.names(arch)
    source = family.source_text(arch)
    options = compile_options(family, arch)
    key = _family_key(family, arch, source, options, names, nvrtc_version())
    c = _compiled.get(key)
    if c is not None:
        return c
    with _lock_for(key):
        c = _compiled.get(key)
        if c is not None:
            return c
        c = _read_cached(key) if _cache_enabled() else None
        if c is None:
            t0 = time.perf_counter()
            cubin, lowered, log = _nvrtc_compile(family, arch, source, options, names)
            secs = time.perf_counter() - t0
            by_mangled = parse_ptxas_log(log)
            resources = {n: by_mangled[m] for n, m in lowered.items() if m in by_mangled}
            c = CompiledFamily(key, family.name, arch.target, cubin, lowered, resources, log, secs)
            _debug(f"compiled {family.name} for {arch.target} in {secs:.2f}s ({len(names)} variants), "
                   f"options {options}")
            if _cache_enabled():
                _write_cached(c, source, options)
        _compiled[key] = c
        return c


# --------------------------------------------------------------------------------------------------------------
# User programs: the same compile, cache and launch for a source of one's own (docs/kernel-api.md)
# --------------------------------------------------------------------------------------------------------------
def resolve_arch(arch=None) -> Arch:
    """An ``Arch`` from a key (``"90a"``), a target (``"sm_90a"``), an ``Arch``, or None for the current device's
    (its generic target: ``sm_90`` on an H100/H200; ask for ``"90a"`` to use wgmma)."""
    if isinstance(arch, Arch):
        return arch
    if arch is None:
        from ._array import gpu_available, no_gpu_message

        if not gpu_available():
            raise ValueError(no_gpu_message("arch=None (the current device's architecture)")
                             + f" Name the target to compile for, one of {', '.join(ARCHS)}.")
        return arch_of_device()
    key = str(arch).lower()
    key = key[3:] if key.startswith("sm_") else key
    if key not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}")
    return ARCHS[key]


@dataclass(frozen=True, eq=False)
class Program:
    """A user's source compiled for one arch by ``compile_source`` / ``compile_file``.

    ``names``: the name expressions asked for; ``lowered``: their mangled symbols; ``resources``: ptxas's report
    per name (``Resources``: registers, spill stores/loads, stack frame, static shared memory); ``log``: NVRTC's
    log (warnings included); ``from_cache``: whether the cubin came from the disk cache. ``kernel(name)`` loads
    one on the current (or given) device, compiling for that device's arch first if it is not ``arch``.
    """

    family: KernelFamily
    arch: Arch
    compiled: CompiledFamily

    @property
    def names(self) -> tuple[str, ...]:
        return self.family.names(self.arch)

    @property
    def lowered(self) -> dict:
        return dict(self.compiled.lowered)

    @property
    def resources(self) -> dict:
        return dict(self.compiled.resources)

    @property
    def log(self) -> str:
        return self.compiled.log

    @property
    def from_cache(self) -> bool:
        return self.compiled.from_cache

    @property
    def cubin(self) -> bytes:
        return self.compiled.cubin

    def kernel(self, name: str | None = None, device_id: int | None = None) -> "Kernel":
        """The loaded kernel ``name`` (default: the only name) on the current or given device; its ``launch``
        runs on the caller's current CuPy stream (``pdl=True`` for programmatic dependent launch on sm_90)."""
        from ._array import require_gpu

        require_gpu("Program.kernel")
        if name is None:
            if len(self.names) != 1:
                raise ValueError(f"this program has {len(self.names)} kernels; name one of {list(self.names)}")
            name = self.names[0]
        if name not in self.names:
            raise ValueError(f"{name!r} is not one of this program's name expressions {list(self.names)}")
        import cupy

        dev = cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
        target = arch_of_device(dev, arch_specific=self.arch.arch_specific)
        # this program's own cubin (not a cache by name: an edited source or header loads as a new module)
        c = self.compiled if target.target == self.arch.target else compile_family(self.family, target)
        return _load(c, self.family.name, name, dev)

    def report(self) -> str:
        """ptxas's figures as a table, one row per name expression."""
        rows = [f"{'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6}  kernel ({self.arch.target})"]
        for n in self.names:
            r = self.compiled.resources.get(n)
            if r is None:
                rows.append(f"{'?':>4} {'?':>11} {'?':>5} {'?':>6}  {n}")
            else:
                rows.append(f"{r.registers:>4} {r.spill_stores:>5}/{r.spill_loads:<5} {r.stack_frame:>5} "
                            f"{r.static_smem:>6}  {n}")
        return "\n".join(rows)


def _as_pairs(defines) -> tuple[tuple[str, str], ...]:
    if defines is None:
        return ()
    items = defines.items() if isinstance(defines, dict) else defines
    out = []
    for item in items:
        k, v = (item, "1") if isinstance(item, str) else item
        if not re.fullmatch(r"[A-Za-z_]\w*", str(k)):
            raise ValueError(f"define name {k!r} is not a C identifier")
        out.append((str(k), str(v)))
    return tuple(out)


def compile_source(source: str, names, *, arch=None, filename: str = "user_kernel.cu", include_dirs=(),
                   defines=None, options=(), hot: bool = False) -> Program:
    """Compile ``source`` (CUDA C++ text) with the library's options for ``arch`` (see ``resolve_arch``; no GPU
    needed when it is named), through the same NVRTC path, disk cache and memory cache as the shipped kernels.

    ``names``: the kernels to export, as C++ name expressions (``"my_kernel"``, ``"tiled<__half, 64>"``).
    ``#include "x.cuh"`` lines are inlined from ``include_dirs`` and then the library's ``kernels_cu`` (so
    ``#include "awq_cupy.cuh"`` gives the device helpers of docs/kernel-api.md); every inlined header is part of the
    cache key. The library defines ``AWQ_CUPY_CC`` and the arch's ``AWQ_ARCH_*`` features; ``defines`` adds more
    (a dict or (name, value) pairs), ``options`` more NVRTC flags. ``filename`` is the name NVRTC's messages use.
    A compile error raises ``CompileError`` carrying NVRTC's log. ``hot=True`` marks the kernels as ones that must
    not spill (``python -m awq_cupy compile --source`` then fails on a spill).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be the CUDA source text (str), got {type(source).__name__}")
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"names={names!r}: give at least one kernel name expression")
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise TypeError("options must be a list of NVRTC option strings")
    target = resolve_arch(arch)
    stem = re.sub(r"\W", "_", Path(filename).stem) or "user_kernel"
    family = KernelFamily(name=f"user_{stem}", source=str(filename), variants=lambda _a, n=names: n, hot=hot,
                          arch_specific=target.arch_specific, defines=_as_pairs(defines), text=source,
                          include_dirs=tuple(str(d) for d in include_dirs), options=tuple(options))
    return Program(family, target, compile_family(family, target))


def compile_file(path, names, **kwargs) -> Program:
    """``compile_source`` of a file: its own folder is searched first for its ``#include "..."`` lines, and NVRTC's
    messages name it."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read kernel source {p}: {e}") from e
    kwargs.setdefault("filename", p.name)
    kwargs["include_dirs"] = (str(p.resolve().parent),) + tuple(kwargs.get("include_dirs", ()))
    return compile_source(text, names, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# Load and launch (GPU only)
# --------------------------------------------------------------------------------------------------------------
class Kernel:
    """A loaded CUDA function of one device. ``launch`` uses the caller's current CuPy stream."""

    __slots__ = ("name", "family", "device_id", "_func", "_smem_set", "resources", "_occupancy")

    def __init__(self, name: str, family: str, device_id: int, func, resources: Resources | None):
        self.name, self.family, self.device_id, self._func = name, family, device_id, func
        self.resources = resources
        self._smem_set = 0
        self._occupancy = {}

    @property
    def func_ptr(self) -> int:
        """The CUfunction handle (for cuLaunchKernelEx: launch.Launch)."""
        return self._func.ptr

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory (needed above 48 KB), once per size increase."""
        if nbytes > 48 * 1024 and nbytes > self._smem_set:
            from cupy_backends.cuda.api import driver

            driver.funcSetAttribute(self._func.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    nbytes)
            self._smem_set = nbytes

    def resident_blocks(self, threads: int, smem: int) -> int:
        """CTAs of this kernel one SM holds at once (CUDA occupancy calculator), cached per (threads, smem)."""
        key = (threads, smem)
        n = self._occupancy.get(key)
        if n is None:
            from cupy_backends.cuda.api import driver

            self.ensure_dynamic_smem(smem)
            n = self._occupancy[key] = max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self._func.ptr, threads, smem))
        return n

    def launch(self, grid: tuple, block: tuple, args: tuple, smem: int = 0, pdl: bool = False) -> None:
        """Launch on the caller's current CuPy stream. ``pdl``: with the programmatic-stream-serialization
        attribute (sm_90+, kernels written for it: common.cuh pdl_wait / pdl_trigger), through cuLaunchKernelEx."""
        for a in args:  # CuPy passes Python ints as int64 and floats as float64: demand explicit widths
            if isinstance(a, (int, float, bool)):
                raise TypeError(f"kernel {self.name}: scalar argument {a!r} must be a numpy scalar "
                                f"(np.int32/np.float32/...), not a Python {type(a).__name__}")
        self.ensure_dynamic_smem(smem)
        if pdl:
            import cupy

            from .driver import Launch

            Launch(self, grid, block, args, smem=smem, pdl=True, stream=cupy.cuda.get_current_stream().ptr).fire()
            return
        # stream=None: CuPy launches on the current stream of the calling thread.
        self._func(tuple(grid), tuple(block), args, shared_mem=smem)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, device={self.device_id})"


_modules: dict[tuple[int, str], object] = {}
_kernels: dict[tuple[int, str, str], Kernel] = {}


def get_kernel(family: KernelFamily, variant, device_id: int | None = None) -> Kernel:
    """The loaded kernel ``variant`` (a name expression of ``family``, or a variant object rendering one) for the
    current (or given) device."""
    import cupy

    variant = variant_expr(variant)
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    fast = _kernels.get((device_id, family.name, variant))
    if fast is not None:
        return fast
    arch = arch_of_device(device_id, arch_specific=family.arch_specific)
    k = _load(compile_family(family, arch), family.name, variant, device_id)
    _kernels[(device_id, family.name, variant)] = k
    return k


_loaded: dict[tuple[int, str, str], Kernel] = {}


def _load(c: CompiledFamily, family_name: str, variant: str, device_id: int) -> Kernel:
    """Kernel ``variant`` of the compiled ``c`` on a device: its module loaded once per (device, cache key)."""
    import cupy

    if variant not in c.lowered:
        raise ValueError(f"kernel family {family_name!r} has no variant {variant!r} on {c.arch}; "
                         f"available: {sorted(c.lowered)}")
    with _lock_for(c.key):
        k = _loaded.get((device_id, c.key, variant))
        if k is not None:
            return k
        mod = _modules.get((device_id, c.key))
        if mod is None:
            with cupy.cuda.Device(device_id):
                mod = cupy.cuda.function.Module()
                mod.load(c.cubin)
            _modules[(device_id, c.key)] = mod
        with cupy.cuda.Device(device_id):
            func = mod.get_function(c.lowered[variant])
        k = _loaded[(device_id, c.key, variant)] = Kernel(variant, family_name, device_id, func,
                                                          c.resources.get(variant))
    return k


def as_i32(v) -> np.int32:
    """A checked int32 kernel argument (raises instead of wrapping)."""
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"kernel argument {v} does not fit in int32")
    return np.int32(v)
