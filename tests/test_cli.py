"""``python -m awq_cupy`` as a user runs it: a subprocess of this interpreter with its own cache folder."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from awq_cupy import jit, kernels
from awq_cupy._array import gpu_available

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, cache: Path, timeout=300):
    env = dict(os.environ, AWQ_CUPY_CACHE_DIR=str(cache))
    env.pop("AWQ_CUPY_DISABLE_CACHE", None)
    return subprocess.run([sys.executable, "-m", "awq_cupy", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def table_rows(stdout: str):
    """The compile table's rows as dicts; the header must name the columns."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no output"
    assert lines[0].split() == ["family", "arch", "regs", "spill", "st/ld", "stack", "smem", "variant"], lines[0]
    rows = []
    for ln in lines[1:]:
        family, arch, regs, spills, stack, smem, variant = ln.split(None, 6)
        stores, loads = spills.split("/")
        rows.append(dict(family=family, arch=arch, regs=int(regs), spill_stores=int(stores), spill_loads=int(loads),
                         stack=int(stack), smem=int(smem), variant=variant))
    return rows


def test_compile_one_family_prints_a_table(tmp_path):
    r = run_cli("compile", "--arch", "90", "--family", "dequant", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert [row["variant"] for row in rows] == list(kernels.DEQUANT.names(jit.ARCHS["90"]))
    for row in rows:
        assert row["family"] == "dequant" and row["arch"] == "sm_90"
        assert row["regs"] > 0 and row["spill_stores"] == row["spill_loads"] == 0
    assert f"{len(rows)} kernel variants compiled, 0 problems" in r.stderr
    assert any((tmp_path / "cache").glob("*/kernel.cubin")), "the CLI compile must fill the cache folder"

    again = run_cli("compile", "--arch", "90", "--family", "dequant", cache=tmp_path / "cache")
    assert again.returncode == 0 and table_rows(again.stdout) == rows
    assert "(cache)" in again.stderr


def test_compile_two_archs_and_families(tmp_path):
    r = run_cli("compile", "--arch", "75,86", "--family", "repack,dequant", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {(row["family"], row["arch"], row["variant"]) for row in table_rows(r.stdout)}
    want = {(f.name, jit.ARCHS[a].target, v) for a in ("75", "86") for f in (kernels.REPACK, kernels.DEQUANT)
            for v in f.names(jit.ARCHS[a])}
    assert got == want


@pytest.mark.parametrize("arch", ["61", "100", "sm_61"])
def test_compile_unknown_arch_exits_2(tmp_path, arch):
    r = run_cli("compile", "--arch", arch, cache=tmp_path / "cache")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"unknown arch '{arch}'" in r.stderr
    assert "supported: 75, 80, 86, 89, 90, 90a" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: bench would run the whole benchmark")
def test_bench_without_gpu_fails_cleanly(tmp_path):
    r = run_cli("bench", cache=tmp_path / "cache")
    assert r.returncode != 0
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip(), "bench must say why it did not run"


def test_help(tmp_path):
    r = run_cli("--help", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "compile" in r.stdout and "bench" in r.stdout
    c = run_cli("compile", "--help", cache=tmp_path / "cache")
    assert c.returncode == 0 and "--arch" in c.stdout and "--family" in c.stdout
    assert not (tmp_path / "cache").exists(), "--help must not compile"


def test_no_command_prints_the_help(tmp_path):
    r = run_cli(cache=tmp_path / "cache")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m awq_cupy"), r.stdout + r.stderr
    for cmd in ("inspect", "convert", "compile", "bench", "tune"):
        assert f"    {cmd} " in r.stdout, cmd
    assert r.stderr == ""


def test_version(tmp_path):
    import awq_cupy

    r = run_cli("--version", cache=tmp_path / "cache")
    assert r.returncode == 0 and r.stdout.strip() == f"awq_cupy {awq_cupy.__version__}"


def test_program_name_follows_how_it_was_called(tmp_path):
    """The console script is ``awq-cupy``; its usage and errors must say so (and the module form its own)."""
    script = Path(sys.executable).parent / "awq-cupy"
    if script.exists():                     # installed by pip install -e . (CI, dev venvs)
        r = subprocess.run([str(script), "compile", "--arch", "61"], capture_output=True, text=True, timeout=60)
    else:
        code = "import sys; sys.argv[0] = '/usr/bin/awq-cupy'; from awq_cupy.cli import main; raise SystemExit(main())"
        r = subprocess.run([sys.executable, "-c", code, "compile", "--arch", "61"], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("usage: awq-cupy compile"), r.stderr


def test_arch_90_means_the_whole_hopper_build(monkeypatch):
    assert _parsed(monkeypatch, "_cmd_compile", ["compile", "--arch", "90"])["arch"] == ["90", "90a"]
    assert _parsed(monkeypatch, "_cmd_compile", ["compile", "--arch", "90a"])["arch"] == ["90a"]
    assert _parsed(monkeypatch, "_cmd_compile", ["compile", "--arch", "sm_86, 90a,90"])["arch"] == ["86", "90a", "90"]
    from awq_cupy import jit

    assert _parsed(monkeypatch, "_cmd_compile", ["compile"])["arch"] is None   # every arch (compile_all)
    assert set(jit.ARCHS) >= {"90", "90a"}


@pytest.mark.parametrize("argv,archs", [([], ["75", "80", "86", "89", "90"]), (["--arch", "90a"], ["90a"]),
                                        (["--ar", "90a"], ["90a"]), (["--arch=80,90"], ["80", "90", "90a"])])
def test_compile_source_targets(monkeypatch, argv, archs):
    """``compile --source``: the generic targets by default (arch-specific code only when named), the named ones
    otherwise, however argparse was given them (an abbreviated option included)."""
    from awq_cupy import cli, jit

    seen = []

    def fake(source, names, arch, **kw):
        seen.append(arch)
        return types.SimpleNamespace(report=lambda: "", log="", resources={}, arch=jit.ARCHS[arch])

    monkeypatch.setattr(jit, "compile_file", fake)
    assert cli.main(["compile", "--source", "mine.cu", "--name", "k", *argv]) == 0
    assert seen == archs


@pytest.mark.parametrize("arch", ["", ",", " "])
def test_compile_empty_arch_is_rejected(tmp_path, arch):
    r = run_cli("compile", "--arch", arch, cache=tmp_path / "cache")
    assert r.returncode == 2 and "no arch given" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "" and not (tmp_path / "cache").exists()


def test_every_option_has_help_and_the_help_names_the_families():
    import argparse

    from awq_cupy import cli

    parser = cli.build_parser("awq-cupy")
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"inspect", "convert", "compile", "bench", "tune"}
    for name, sp in subs.choices.items():
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest} has no help"
    text = subs.choices["compile"].format_help()
    for fam in kernels.FAMILIES:
        assert fam in text, fam
    assert "90a" in text and "sm_90 and sm_90a" in " ".join(text.split())


def test_tune_help_shows_the_real_default_table_path(tmp_path):
    r = run_cli("tune", "--help", cache=tmp_path / "cache")
    env_dispatch = os.environ.get("AWQ_CUPY_DISPATCH")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    if env_dispatch == "builtin":           # conftest sets it; the subprocess inherits it
        assert "AWQ_CUPY_DISPATCH=builtin disables the default" in text
    env = dict(os.environ, AWQ_CUPY_CACHE_DIR=str(tmp_path / "c2"))
    env.pop("AWQ_CUPY_DISPATCH", None)
    r = subprocess.run([sys.executable, "-m", "awq_cupy", "tune", "--help"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and str(tmp_path / "c2" / "dispatch.json") in "".join(r.stdout.split()), r.stdout


def test_compile_unknown_family_exits_2(tmp_path):
    r = run_cli("compile", "--arch", "90", "--family", "nope", cache=tmp_path / "cache")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown kernel family 'nope'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: bench would run")
def test_bench_without_gpu_says_so(tmp_path):
    r = run_cli("bench", "--quick", cache=tmp_path / "cache")
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--m", "0,1"], "expected positive integers"),
    (["--m", "a"], "expected comma-separated integers"),
    (["--shapes", "4096x6"], "multiples of 8"),
    (["--shapes", "4096"], "KxN pairs"),
    (["--dtype", "float32"], "invalid choice"),
    (["--models", "gpt2"], "invalid choice"),
    (["--contenders", "torch"], "invalid choice"),
])
def test_bench_rejects_bad_arguments(tmp_path, args, message):
    r = run_cli("bench", *args, cache=tmp_path / "cache")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def _parsed(monkeypatch, handler, argv):
    """The arguments ``python -m awq_cupy argv`` hands to ``cli.<handler>`` (which is not run)."""
    from awq_cupy import cli

    captured = {}

    def fake(args):
        captured.update(vars(args))
        return 0

    monkeypatch.setattr(cli, handler, fake)
    assert cli.main(argv) == 0
    return captured


def test_bench_arguments_parse(monkeypatch):
    captured = _parsed(monkeypatch, "_cmd_bench", ["bench", "--m", "1,16", "--shapes", "4096x6144,14336x4096",
                                                   "--bf16", "--quick", "--group-size", "64", "--json", "r.json"])
    assert captured["m"] == [1, 16] and captured["shapes"] == [(4096, 6144), (14336, 4096)]
    assert captured["dtype"] == "bfloat16" and captured["quick"] and captured["group_size"] == 64
    assert captured["json"] == "r.json"


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: tune would run")
def test_tune_without_gpu_says_so(tmp_path):
    r = run_cli("tune", "--m", "1,16", cache=tmp_path / "cache")
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cache" / "dispatch.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--m", "0"], "expected positive integers"),
    (["--dtype", "int8"], "invalid choice"),
    (["--models", "gpt2"], "invalid choice"),
])
def test_tune_rejects_bad_arguments(tmp_path, args, message):
    r = run_cli("tune", *args, cache=tmp_path / "cache")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tune_arguments_parse(monkeypatch):
    captured = _parsed(monkeypatch, "_cmd_tune", ["tune", "--m", "1,8,256", "--models", "llama-2-70b", "--out", "t.json"])
    assert captured["m"] == [1, 8, 256] and captured["models"] == ["llama-2-70b"] and captured["out"] == "t.json"
