"""The README's snippets run as they are. Each fenced ``python`` block carries a marker line just above it,
``<!-- snippet: cpu|gpu|minilm|shell -->`` (a ``bash`` block only when it is marked ``shell``); every python block
must have one, so none goes unchecked. Each snippet runs in a fresh interpreter in an empty folder: CPU ones
everywhere (CI), GPU ones under the ``gpu`` marker, the MiniLM one when its model package is installed."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from awq_cupy.models import minilm

REPO = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"(?:<!-- snippet: (\w+) -->\n)?```(\w+)\n(.*?)^```", re.S | re.M)
KINDS = ("cpu", "gpu", "minilm", "shell")


def snippets(text: str):
    """[(kind or None, language, code, line number)] of every fenced block."""
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(2 if m.group(1) is None else 1)) + 1
        out.append((m.group(1), m.group(2), m.group(3), line))
    return out


README = (REPO / "README.md").read_text(encoding="utf-8")
SNIPPETS = [s for s in snippets(README) if s[0] is not None]
MINILM_MISSING = [p for p in (minilm.MODEL_PACKAGE, "tokenizers") if importlib.util.find_spec(p) is None]


def test_every_python_snippet_is_marked_and_the_markers_are_known():
    blocks = snippets(README)
    unmarked = [line for kind, lang, _, line in blocks if lang == "python" and kind is None]
    assert not unmarked, f"README python blocks without a snippet marker (lines {unmarked})"
    assert all(kind in KINDS for kind, *_ in SNIPPETS), [k for k, *_ in SNIPPETS]
    assert all((lang == "bash") == (kind == "shell") for kind, lang, *_ in SNIPPETS)
    assert {k for k, *_ in SNIPPETS} >= {"cpu", "gpu", "shell"}


def _params():
    for kind, lang, code, line in SNIPPETS:
        marks = [pytest.mark.gpu] if kind == "gpu" else []
        if kind == "minilm":
            marks.append(pytest.mark.skipif(bool(MINILM_MISSING), reason=f"needs {MINILM_MISSING}"))
        yield pytest.param(kind, code, id=f"{kind}-line{line}", marks=marks)


@pytest.mark.parametrize("kind,code", list(_params()))
def test_snippet_runs(kind, code, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO))
    if kind == "shell":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"snippet failed:\n{code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    if kind == "shell":       # the commands it shows did their job
        assert (tmp_path / "report.json").stat().st_size > 0
        assert (tmp_path / "demo-gemm" / "model.safetensors").is_file()
