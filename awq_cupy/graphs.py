"""CUDA graphs without traps: ``capture(step)`` warms a step's call shapes up, captures it once and replays it.

A model's decode step is many small launches; replayed from a CUDA graph its host cost is one launch. Capturing
by hand has two traps with awq_cupy: a call shape that has not run yet cannot load its compiled kernel during the
capture (it takes the generic GEMV, same bits but slower), and memory that the captured region allocates from
CuPy's pool and frees can be handed out again while the graph still writes it. ``capture`` avoids both: it runs
the step eagerly first (compiling and loading every kernel it uses), then captures it on a private stream with a
private memory pool and private workspaces that live as long as the returned ``CapturedStep``.
"""
from __future__ import annotations

from ._array import require_gpu

__all__ = ["CapturedStep", "capture"]


class CapturedStep:
    """A step captured as a CUDA graph. Calling it replays the graph on the caller's current stream (no
    synchronisation) and returns ``outputs``: what the step returned while it was captured, the same arrays at
    every replay, overwritten by each.

    Lifetime rules:
    - Inputs: the graph reads the device memory the step read while captured. Write new inputs into those same
      arrays (``x[...] = ...``, ``cupy.copyto``) before a replay; rebinding a Python name to a new array does not
      reach the graph. The step object keeps the arrays passed to ``capture`` alive.
    - Outputs: ``outputs`` (and every array the step allocated while captured) live in the step's own memory pool,
      kept as long as the step; copy what must outlast the next replay.
    - Weights and other arrays the step closes over must stay alive and in place as long as the step.
    - Host code in the step (Python branches, printing, reading values back) ran once, at capture: a replay
      repeats only the GPU work.
    - Replays on one stream run in order. Replaying one step on two streams at once races on its outputs and
      workspaces; capture one step per stream instead.
    - Where eager ``matmul`` takes dequantize + cuBLAS (fp16, M >= 768 on the H200), the graph runs the fused GEMM
      (CuPy cannot capture cuBLAS): there the replay's bits differ from the eager call's. Everywhere else they are
      the same.
    """

    def __init__(self, graph, outputs, pool, workspaces, stream, keep):
        self._graph, self.outputs = graph, outputs
        self._pool, self._workspaces, self._stream, self._keep = pool, workspaces, stream, keep

    def __call__(self):
        self._graph.launch()   # on the current stream
        return self.outputs

    def replay(self, stream=None):
        """Replay on ``stream`` (a cupy.cuda.Stream; default the current one); returns ``outputs``."""
        self._graph.launch(stream=stream)
        return self.outputs

    def __repr__(self) -> str:
        return f"CapturedStep(outputs={type(self.outputs).__name__})"


def capture(step, *args, warmup: int = 1, **kwargs) -> CapturedStep:
    """Run ``step(*args, **kwargs)`` ``warmup`` times eagerly on the current stream (at least once: that compiles
    and loads every kernel its call shapes need), then capture one call of it as a CUDA graph on a private stream
    and return the ``CapturedStep`` that replays it (see its lifetime rules). The step must do only GPU work that
    CUDA graphs can capture: awq_cupy calls and CuPy kernels on preallocated or freshly allocated arrays, no
    device-to-host copies and no cuBLAS (``cupy.matmul``)."""
    import cupy

    from . import launch

    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup={warmup!r}: at least one eager run, so that every kernel is loaded before capture")
    require_gpu("awq_cupy.capture")
    for _ in range(warmup):
        step(*args, **kwargs)
    caller = cupy.cuda.get_current_stream()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(caller.record())      # nothing in flight on the caller's stream is left racing the capture
    pool = cupy.cuda.MemoryPool()
    workspaces: dict = {}
    with stream, cupy.cuda.using_allocator(pool.malloc), launch.capture_scope(workspaces):
        stream.begin_capture()
        try:
            outputs = step(*args, **kwargs)
        except BaseException:
            try:
                stream.end_capture()
            except Exception:   # the capture was already invalidated; the step's own error is the one to see
                pass
            raise
        graph = stream.end_capture()
    return CapturedStep(graph, outputs, pool, workspaces, stream, (step, args, kwargs))
