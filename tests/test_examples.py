"""The scripts in examples/ run and say what they claim: each in a fresh interpreter, small sizes."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_example(name, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_quantize_awq_beats_round_to_nearest(tmp_path):
    out = run_example("quantize_awq.py", "--hidden", "512", "--tokens", "1024", "--out", str(tmp_path / "ck"))
    rtn = float(re.search(r"^RTN\s+([0-9.]+)", out, re.M).group(1))
    awq = float(re.search(r"^AWQ\s+([0-9.]+)", out, re.M).group(1))
    assert 0 < awq < rtn, out
    assert (tmp_path / "ck" / "model.safetensors").is_file() and "read back and checked" in out


@pytest.mark.gpu
def test_run_checkpoint_fused_matches_separate(tmp_path):
    out = run_example("run_checkpoint.py", "--repeats", "3")
    diff = float(re.search(r"max relative difference ([0-9.e+-]+)", out).group(1))
    assert diff < 2e-2, out
    assert re.search(r"28 layers .* 16 weights after fusing \(8 fused\)", out), out


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", ["1", "16"])
def test_capture_decode_step_replays_bitwise(tokens):
    out = run_example("capture_decode_step.py", "--small", "--layers", "3", "--tokens", tokens, "--repeats", "3")
    assert "replay == eager bitwise: True" in out, out
