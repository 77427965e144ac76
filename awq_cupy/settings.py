"""Per-process settings of the matmul path, read from the environment once (at the first call that needs them)
instead of on every call.

``AWQ_CUPY_PDL``: "0" launches the GEMV / GEMM kernels without programmatic dependent launch (compute capability
9.0). ``AWQ_CUPY_WGMMA``: "0" makes compute capability 9.0 run the mma.sync GEMM instead of the wgmma one.
``AWQ_CUPY_GEMV_SHAPES``: "auto" (default), "0" or "1": whether the GEMV is compiled for its launch shape
(``plans.gemv_specializes``). ``AWQ_CUPY_DISPATCH``: the tuned dispatch table (``dispatch.table_path``).

A process that changes these variables, or edits the tuned table, after its first ``matmul`` calls ``reload()``:
it reads them again, forgets the tuned table read so far and drops every cached launch plan, so the next calls plan
afresh. (The compile cache's variables, AWQ_CUPY_CACHE_DIR, AWQ_CUPY_DISABLE_CACHE and AWQ_CUPY_JIT_DEBUG, are read
by each compile, off the hot path.)
"""
from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass
from typing import Callable

__all__ = ["GemvShapes", "Settings", "current", "reload", "on_reload"]


class GemvShapes(enum.Enum):
    """``AWQ_CUPY_GEMV_SHAPES``: compile the GEMV for its launch shape on model-sized weights, never, or always."""
    AUTO = "auto"
    NEVER = "0"
    ALWAYS = "1"


@dataclass(frozen=True)
class Settings:
    pdl: bool = True
    wgmma: bool = True
    gemv_shapes: GemvShapes = GemvShapes.AUTO
    dispatch: str = ""          # AWQ_CUPY_DISPATCH as set ("" unset, "builtin", or a path)

    @classmethod
    def from_environ(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        raw = env.get("AWQ_CUPY_GEMV_SHAPES", "auto")
        try:
            shapes = GemvShapes(raw)
        except ValueError:
            raise ValueError(f"AWQ_CUPY_GEMV_SHAPES={raw!r}: 0 (never), 1 (always) or auto") from None
        return cls(pdl=env.get("AWQ_CUPY_PDL", "1") != "0", wgmma=env.get("AWQ_CUPY_WGMMA", "1") != "0",
                   gemv_shapes=shapes, dispatch=env.get("AWQ_CUPY_DISPATCH", ""))


_current: Settings | None = None
_hooks: list[Callable[[], None]] = []
_lock = threading.Lock()


def current() -> Settings:
    """The settings in force: read from the environment at the first call, then kept until ``reload``."""
    s = _current
    if s is None:
        with _lock:
            s = _current if _current is not None else _set(Settings.from_environ())
    return s


def _set(s: Settings) -> Settings:
    global _current
    _current = s
    return s


def on_reload(hook: Callable[[], None]) -> None:
    """Register ``hook`` to run at every ``reload`` (the caches that depend on the settings: launch plans, the
    tuned table)."""
    if hook not in _hooks:
        _hooks.append(hook)


def reload() -> Settings:
    """Read the environment again and drop what was planned from the old settings (every registered cache). An
    invalid value raises ValueError here and at every later ``current()`` until it is fixed."""
    try:
        with _lock:
            _set(None)
            s = _set(Settings.from_environ())
    finally:
        for hook in list(_hooks):
            hook()
    return s
