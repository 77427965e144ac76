"""Shared pytest setup: the ``gpu`` marker skips (with the reason printed by ``-ra``) when no GPU answers."""
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from awq_cupy._array import gpu_available

# The tests check the built-in dispatch table, not a table `python -m awq_cupy tune` may have written on this machine.
os.environ.setdefault("AWQ_CUPY_DISPATCH", "builtin")

# Golden layers packed by AutoAWQ's own code (copied from shared/fixtures/awq-reference; see its README).
FIXTURES = Path(os.environ.get("AWQ_CUPY_FIXTURES", Path(__file__).resolve().parent / "data" / "awq-reference"))


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available (cupy.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh, reproducible generator per test (seeded from the test's name)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _settings_follow_the_environment():
    """Tests that set AWQ_CUPY_* variables call ``settings.reload()`` themselves; after each test (and monkeypatch's
    undo of its variables) the settings are read again, so that no test sees another's."""
    from awq_cupy import settings

    yield
    settings.reload()
