"""Without a GPU: every public entry point that needs one says so in the words ``bench`` uses (not CuPy's driver
error), and the CPU routes (dequantize of a checkpoint layer) work. Run everywhere by making the probe say "no GPU"."""
import subprocess
import sys

import numpy as np
import pytest

import awq_cupy
from awq_cupy import _array, formats
from awq_cupy.checkpoint import load_checkpoint, save_checkpoint
from awq_cupy.quantize import quantize

REASON = "cupy.cuda.is_available() is False: no NVIDIA driver here (libcuda does not load)"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(_array, "_GPU_AVAILABLE", False)
    monkeypatch.setattr(_array, "_NO_GPU_REASON", REASON)


def _layer(rng, K=128, N=64, G=64):
    qt = quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float16), G)
    return qt, formats.pack(qt.Q, qt.Z, qt.S, "gemm", G)


def test_message_names_the_entry_point_and_the_reason(no_gpu):
    assert _array.no_gpu_message("python -m awq_cupy bench") == (
        f"python -m awq_cupy bench needs a CUDA GPU: none is available here ({REASON}).")
    with pytest.raises(_array.GPUUnavailableError) as e:
        _array.require_gpu("awq_cupy.matmul")
    assert str(e.value).startswith(f"awq_cupy.matmul needs a CUDA GPU: none is available here ({REASON}).")
    assert "awq_cupy.dequantize(layer)" in str(e.value)      # and points at what works on the CPU
    assert isinstance(e.value, RuntimeError)


# matmul and bind take a QuantizedWeight, which only the constructors below make: they are where it is said
@pytest.mark.parametrize("entry", ["from_gemm", "from_checkpoint", "from_dense", "gemm", "dequantize_gemm",
                                   "capture"])
def test_every_gpu_entry_point_says_it_needs_a_gpu(no_gpu, rng, entry):
    qt, p = _layer(rng)
    x = np.zeros((1, 128), np.float16)
    calls = {
        "from_gemm": lambda: awq_cupy.QuantizedWeight.from_gemm(p["qweight"], p["qzeros"], p["scales"], 64),
        "from_checkpoint": lambda: awq_cupy.QuantizedWeight.from_checkpoint(p, group_size=64),
        "from_dense": lambda: awq_cupy.QuantizedWeight.from_dense(np.zeros((64, 128), np.float16), 64),
        "gemm": lambda: awq_cupy.gemm(x, p["qweight"], p["qzeros"], p["scales"], 64),
        "dequantize_gemm": lambda: awq_cupy.dequantize_gemm(p["qweight"], p["qzeros"], p["scales"], 64),
        "capture": lambda: awq_cupy.capture(lambda: None),
    }
    names = {"from_gemm": "QuantizedWeight.from_gemm", "from_checkpoint": "QuantizedWeight.from_checkpoint",
             "from_dense": "QuantizedWeight.from_dense", "gemm": "awq_cupy.gemm",
             "dequantize_gemm": "awq_cupy.dequantize_gemm", "capture": "awq_cupy.capture"}
    with pytest.raises(awq_cupy.GPUUnavailableError, match=f"^{names[entry]} needs a CUDA GPU"):
        calls[entry]()


def test_dequantize_a_checkpoint_layer_on_the_cpu(tmp_path, rng, no_gpu):
    qt, _ = _layer(rng, K=192, N=40, G=64)
    save_checkpoint(tmp_path / "m", {"lin": qt}, group_size=64)
    with load_checkpoint(tmp_path / "m") as ck:
        layer = ck.layers["lin"]
        g = np.arange(192) // 64
        want32 = (qt.Q.astype(np.float32) - qt.Z[g].astype(np.float32)) * qt.S[g].astype(np.float32)
        W = awq_cupy.dequantize(layer)
        assert isinstance(W, np.ndarray) and W.dtype == np.float16 and W.shape == (192, 40)
        assert np.array_equal(W, want32.astype(np.float16))
        assert np.array_equal(awq_cupy.dequantize(layer, np.float32), want32)
        assert np.array_equal(layer.dequantize(), W)
    assert np.array_equal(awq_cupy.dequantize(qt), want32.astype(np.float16))      # quantize()'s result too
    with pytest.raises(TypeError, match="CPU route returns a new numpy array"):
        awq_cupy.dequantize(qt, out=np.empty((192, 40), np.float16))
    with pytest.raises(TypeError, match="QuantizedLayer or QuantizedTensors"):
        awq_cupy.dequantize(np.zeros((4, 4)))


def test_probe_reports_a_missing_cupy_clearly():
    """In a fresh interpreter where ``import cupy`` fails, the reason says so (and how to install it)."""
    code = ("import sys; sys.modules['cupy'] = None\n"
            "from awq_cupy import _array\n"
            "print(_array.gpu_available()); print(_array.no_gpu_message('x'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == "False"
    assert second.startswith("x needs a CUDA GPU: none is available here (CuPy does not import")
    assert '.[cuda13]' in second
