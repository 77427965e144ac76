"""The built wheel ships the CUDA sources, and an installed copy (outside the source tree) finds and compiles them.

The wheel is built by pip from a copy of the files the build reads (so a stale ``build/`` folder of the checkout
cannot leak into it). When the interpreter's setuptools can build wheels by itself (setuptools >= 70.1, or an
older one with the ``wheel`` package) the build runs without isolation and offline; otherwise pip builds in an
isolated environment and fetches setuptools from the package index.

The install goes to a fresh ``--target`` folder put first on PYTHONPATH of a subprocess whose working directory
is an empty folder: ``awq_cupy`` then comes from the wheel, while CuPy and the NVIDIA wheels come from this
interpreter's environment. (A ``venv --system-site-packages`` would not do: it sees the base interpreter's
packages, not those of the venv that runs the tests, and the NVIDIA library lookup only searches site dirs.)
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from awq_cupy import jit, kernels

REPO = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "awq_cupy", "kernels_cu")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pip") is None,
                                reason="pip is not installed in this interpreter, so no wheel can be built")


def kernel_files() -> list[str]:
    return sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.is_file() and not p.name.startswith("."))


def project_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml has no version"
    return m.group(1)


def setuptools_builds_offline() -> bool:
    try:
        v = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(x) for x in re.findall(r"\d+", v)[:2])
    return (major, minor) >= (61, 0) and ((major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel_build")
    src = root / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.exists():
            shutil.copy2(p, src / name)
    out = root / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(src)]
    if setuptools_builds_offline():
        cmd.insert(5, "--no-build-isolation")
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("awq_cupy-*.whl"))
    assert len(wheels) == 1, (wheels, r.stdout)
    return wheels[0]


def test_wheel_ships_every_kernel_source(wheel):
    assert wheel.name == f"awq_cupy-{project_version()}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        files = kernel_files()
        assert {"common.cuh", "dequant.cu", "gemm_tc.cu", "repack.cu"} <= set(files)
        for f in files:
            inside = f"awq_cupy/kernels_cu/{f}"
            assert inside in names, f"{inside} missing from {wheel.name}: {sorted(names)}"
            assert z.read(inside) == (REPO / "kernels_cu" / f).read_bytes(), inside
        py = {p.name for p in (REPO / "awq_cupy").glob("*.py")}
        assert {f"awq_cupy/{n}" for n in py} <= names
        dist_info = f"awq_cupy-{project_version()}.dist-info/"
        stray = [n for n in names if not (n.startswith("awq_cupy/") or n.startswith(dist_info))]
        assert not stray, f"files outside the package: {stray}"
        # the product only: every .cu is the source of a shipped family, every header is included by one of them
        shipped = {f.source for f in kernels.FAMILIES.values()}
        cu = {n.rsplit("/", 1)[1] for n in names if n.startswith("awq_cupy/kernels_cu/") and n.endswith(".cu")}
        assert cu == shipped, f"kernel sources that no shipped family compiles: {sorted(cu - shipped)}"
        included = "".join(jit.read_source(f) for f in shipped)
        headers = {n.rsplit("/", 1)[1] for n in names if n.endswith(".cuh")}
        assert all(f"// ---- begin {h}" in included for h in headers), headers
        assert not [n for n in names if "probe" in n or "bench_util" in n], "a probe in the wheel"
        meta = z.read(dist_info + "METADATA").decode()
        assert "Provides-Extra: cuda13" in meta and "Provides-Extra: test" in meta
        assert "awq-cupy = awq_cupy.cli:main" in z.read(dist_info + "entry_points.txt").decode()


_CHECK = r"""
import hashlib, json, sys
from pathlib import Path
import awq_cupy
from awq_cupy import jit, kernels
from awq_cupy.jit import read_source

names = sys.argv[1].split(",")
kdir = jit.kernel_dir()
rows = kernels.compile_all(["90"], ["dequant"])
print(json.dumps(dict(
    package=str(Path(awq_cupy.__file__).resolve()),
    version=awq_cupy.__version__,
    paths={n: str(Path(str(kdir.joinpath(n))).resolve()) for n in names},
    sources={n: hashlib.sha256(read_source(n).encode()).hexdigest() for n in names},
    rows=[(r["arch"], r["variant"], r["registers"], r["spill_stores"] + r["spill_loads"]) for r in rows],
)))
"""


def test_installed_wheel_reads_and_compiles_its_own_sources(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), AWQ_CUPY_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("AWQ_CUPY_DISABLE_CACHE", None)
    files = kernel_files()
    r = subprocess.run([sys.executable, "-c", _CHECK, ",".join(files)], cwd=run_dir, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])

    site_r = site.resolve()
    assert Path(got["package"]).is_relative_to(site_r), got["package"]
    assert got["version"] == project_version()
    for name, path in got["paths"].items():
        p = Path(path)
        assert p.is_relative_to(site_r) and not p.is_relative_to(REPO.resolve()), (name, path)
        assert p == site_r / "awq_cupy" / "kernels_cu" / name
        want = hashlib.sha256(jit.read_source(name).encode()).hexdigest()
        assert got["sources"][name] == want, f"{name} read from the install differs from the source tree's"
    variants = [v for _, v, _, _ in got["rows"]]
    assert variants == list(kernels.DEQUANT.names(jit.ARCHS["90"]))
    assert all(arch == "sm_90" and regs > 0 and spills == 0 for arch, _, regs, spills in got["rows"]), got["rows"]
    assert any((tmp_path / "cache").glob("*/kernel.cubin"))
