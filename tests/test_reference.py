"""Tests for awq_cupy.reference: exact dequantization, float64 matmul, the fp16/bf16 baseline and the
tolerance helper whose failure messages every kernel test relies on."""
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import load_file

from awq_cupy.formats import pack, unpack, unpack_scaled_zeros
from awq_cupy.reference import (assert_close, dequantize, dequantize_packed, matmul, matmul_baseline,
                                matmul_packed)

BF16 = np.dtype(ml_dtypes.bfloat16)
INDEX = json.loads((FIXTURES / "index.json").read_text())


def _random_logical(rng, K, N, G):
    NG = K // (K if G == -1 else G)
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (NG, N), dtype=np.uint8)
    S = (rng.uniform(1e-3, 5e-2, (NG, N)) * rng.choice([-1.0, 1.0], (NG, N))).astype(np.float16)
    return Q, Z, S


def _direct_weight(Q, Z, S, G, dtype):
    """W from the definition, element by element through an explicit group index (no reshapes)."""
    K = Q.shape[0]
    g = np.arange(K) // (K if G == -1 else G)
    return (Q.astype(dtype) - Z[g].astype(dtype)) * S[g].astype(dtype)


# ------------------------------------------------------------------------------------------------------------
# dequantize
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K, N, G", [(256, 64, 128), (1024, 32, 32), (384, 16, -1), (11008, 8, 64)])
def test_dequantize_matches_definition(rng, K, N, G):
    Q, Z, S = _random_logical(rng, K, N, G)
    W32 = _direct_weight(Q, Z, S, G, np.float32)
    W64 = _direct_weight(Q, Z, S, G, np.float64)
    got32 = dequantize(Q, Z, S, G)
    assert got32.dtype == np.float32 and got32.shape == (K, N)
    np.testing.assert_array_equal(got32, W32)
    np.testing.assert_array_equal(dequantize(Q, Z, S, G, dtype=np.float64), W64)
    np.testing.assert_array_equal(W32.astype(np.float64), W64)        # (q - z)·s is exact in float32
    # float16: one rounding of the exact value, bit for bit (what the GPU dequant kernel produces, docs/formats.md §Dequantization)
    got16 = dequantize(Q, Z, S, G, dtype=np.float16)
    assert got16.dtype == np.float16
    np.testing.assert_array_equal(got16.view(np.uint16), W32.astype(np.float16).view(np.uint16))
    gotbf = dequantize(Q, Z, S, G, dtype=BF16)
    assert gotbf.dtype == BF16
    np.testing.assert_array_equal(gotbf.view(np.uint16), W32.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(dequantize(Q, Z, S, G, dtype="bfloat16").view(np.uint16),
                                  gotbf.view(np.uint16))


def test_dequantize_accepts_any_integer_codes(rng):
    Q, Z, S = _random_logical(rng, 128, 16, 64)
    want = dequantize(Q, Z, S, 64)
    np.testing.assert_array_equal(dequantize(Q.astype(np.int32), Z.astype(np.int64), S, 64), want)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, "float8"])
def test_dequantize_rejects_output_dtypes(rng, dtype):
    Q, Z, S = _random_logical(rng, 128, 16, 64)
    with pytest.raises(TypeError, match="dtype"):
        dequantize(Q, Z, S, 64, dtype=dtype)


def test_dequantize_validates_inputs(rng):
    Q, Z, S = _random_logical(rng, 128, 16, 64)
    with pytest.raises(ValueError, match="K=128 is not a multiple of group_size=96"):
        dequantize(Q, Z, S, 96)
    Q[0, 0] = 17
    with pytest.raises(ValueError, match=r"Q must hold unsigned 4-bit values 0..15; found 17 at index \(0, 0\)"):
        dequantize(Q, Z, S, 64)


@pytest.mark.parametrize("fmt", ["gemm", "gemv", "gemv_fast"])
def test_dequantize_packed(rng, fmt):
    K, N, G = 512, 64, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    packed = pack(Q, Z, S, fmt, G)
    got = dequantize_packed(packed, fmt, K, G, dtype=np.float16)
    exact = dequantize(Q, Z, S, G, dtype=np.float16)
    assert got.shape == (K, N) and got.dtype == np.float16
    if fmt != "gemv_fast":
        np.testing.assert_array_equal(got.view(np.uint16), exact.view(np.uint16))
    else:
        # kernel semantics: one rounding of Q·S + SZ with the stored (fp16-rounded) SZ
        Qk, S32, SZ32 = unpack_scaled_zeros(packed, K, G)
        g = np.arange(K) // G
        want = (Qk.astype(np.float32) * S32[g] + SZ32[g]).astype(np.float16)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert not np.array_equal(got, exact)     # the SZ rounding is visible against (Q - Z)·S


def test_dequantize_packed_float64_gemv_fast_is_exact_sum(rng):
    K, N, G = 256, 32, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    packed = pack(Q, Z, S, "gemv_fast", G)
    w32 = dequantize_packed(packed, "gemv_fast", K, G, dtype=np.float32)
    w64 = dequantize_packed(packed, "gemv_fast", K, G, dtype=np.float64)
    np.testing.assert_array_equal(w32.astype(np.float64), w64)   # Q·S + SZ fits float32 exactly


# ------------------------------------------------------------------------------------------------------------
# matmul and the baseline
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype", [np.float16, BF16, np.float32, np.float64])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
def test_matmul_matches_direct_float64(rng, x_dtype, lead):
    K, N, G = 384, 48, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    x = rng.standard_normal(lead + (K,)).astype(x_dtype)
    bias = rng.standard_normal(N).astype(np.float16)
    W = _direct_weight(Q, Z, S, G, np.float64)
    want = np.einsum("...k,kn->...n", x.astype(np.float64), W) + bias.astype(np.float64)
    got = matmul(x, Q, Z, S, G, bias=bias)
    assert got.dtype == np.float64 and got.shape == lead + (N,)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    no_bias = matmul(x, Q, Z, S, G)
    np.testing.assert_allclose(no_bias, want - bias.astype(np.float64), rtol=1e-12, atol=1e-12 * np.abs(want).max())
    got32 = matmul(x, Q, Z, S, G, bias=bias, dtype=np.float32)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("entry", [e for e in INDEX if e["format"] in ("gemm", "gemv_fast")],
                         ids=lambda e: e["file"].removesuffix(".safetensors"))
def test_matmul_packed_on_fixtures(rng, entry):
    fmt, K, N, G = entry["format"], entry["in_features"], entry["out_features"], entry["group_size"]
    t = load_file(str(FIXTURES / entry["file"]))
    tensors = {k: t[k] for k in ("qweight", "qzeros", "scales", "bias")}
    x = rng.standard_normal((5, K)).astype(np.float16)
    got = matmul_packed(x, tensors, fmt, K, G)            # bias taken from the tensors
    assert got.shape == (5, N) and got.dtype == np.float64
    x64, b64 = x.astype(np.float64), t["bias"].astype(np.float64)
    if fmt == "gemm":
        W = _direct_weight(*unpack(tensors, fmt, K, G), G, np.float64)
    else:                                                 # kernel semantics: W = Q·S + SZ
        Q, S32, SZ32 = unpack_scaled_zeros(tensors, K, G)
        g = np.arange(K) // G
        W = Q.astype(np.float64) * S32[g] + SZ32[g]
    want = x64 @ W + b64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    # the float16 fake-quantized weight AutoAWQ computed is the same layer up to fp16 weight rounding
    fake = x64 @ t["weight_fake_quant"].T.astype(np.float64) + b64
    assert np.abs(got - fake).max() < 1e-2 * np.abs(fake).max()
    no_bias = matmul_packed(x, tensors, fmt, K, G, bias=np.zeros(N, np.float16))
    np.testing.assert_allclose(got - no_bias, np.broadcast_to(t["bias"].astype(np.float64), got.shape),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_matmul_baseline_rounds_like_half_precision(rng, dtype):
    K, N, G = 512, 64, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    x = rng.standard_normal((8, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    base = matmul_baseline(x, Q, Z, S, G, bias=bias, dtype=dtype)
    assert base.dtype == np.dtype(dtype) and base.shape == (8, N)
    # the definition: x, W and bias rounded to dtype, float64 accumulation, one final rounding
    W = dequantize(Q, Z, S, G, dtype=dtype).astype(np.float64)
    want = (x.astype(dtype).astype(np.float64) @ W + bias.astype(dtype).astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(base.view(np.uint16), want.view(np.uint16))
    ref = matmul(x, Q, Z, S, G, bias=bias)
    err = np.abs(base.astype(np.float64) - ref).max()
    assert 0 < err < 0.05 * np.abs(ref).max()
    assert_close(base, ref, base, c=1.0, atol=0.0, name="baseline vs itself")


def test_bf16_baseline_is_coarser_than_fp16(rng):
    K, N, G = 512, 64, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    x = rng.standard_normal((16, K)).astype(np.float32)
    ref = matmul(x, Q, Z, S, G)
    err16 = np.abs(matmul_baseline(x, Q, Z, S, G).astype(np.float64) - ref).max()
    errbf = np.abs(matmul_baseline(x, Q, Z, S, G, dtype=BF16).astype(np.float64) - ref).max()
    assert errbf > 2 * err16


def test_matmul_validates_inputs(rng):
    Q, Z, S = _random_logical(rng, 256, 32, 128)
    x = rng.standard_normal((3, 256)).astype(np.float16)
    with pytest.raises(ValueError, match=r"x has shape \(3, 128\); its last dimension must be K=256"):
        matmul(x[:, :128], Q, Z, S, 128)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        matmul(x.astype(np.int32), Q, Z, S, 128)
    with pytest.raises(ValueError, match=r"bias has shape \(16,\), expected \(N,\) = \(32,\)"):
        matmul(x, Q, Z, S, 128, bias=np.zeros(16, np.float16))
    with pytest.raises(TypeError, match="matmul dtype must be one of"):
        matmul(x, Q, Z, S, 128, dtype=np.float16)
    with pytest.raises(TypeError, match="matmul_baseline dtype must be one of"):
        matmul_baseline(x, Q, Z, S, 128, dtype=np.float32)
    with pytest.raises(ValueError, match="K=256 is not a multiple of group_size=96"):
        matmul(x, Q, Z, S, 96)


# ------------------------------------------------------------------------------------------------------------
# assert_close
# ------------------------------------------------------------------------------------------------------------

def _triple(rng, shape=(6, 10)):
    ref = rng.standard_normal(shape)
    baseline = (ref + rng.uniform(-1e-3, 1e-3, shape)).astype(np.float64)
    return ref, baseline


def test_assert_close_passes_within_tolerance(rng):
    ref, baseline = _triple(rng)
    base_err = np.abs(baseline - ref).max()
    assert_close(ref.copy(), ref, baseline)
    assert_close(baseline, ref, baseline, c=1.0, atol=0.0)
    out = ref + 1.9 * base_err
    assert_close(out, ref, baseline, c=2.0, atol=0.0)
    assert_close(out.astype(np.float16), ref.astype(np.float16), baseline, c=2.0, atol=1e-2)


def test_assert_close_reports_a_planted_error(rng):
    ref, baseline = _triple(rng)
    out = ref.copy()
    out[2, 7] += 0.5
    out[4, 1] -= 0.25
    with pytest.raises(AssertionError) as info:
        assert_close(out, ref, baseline, c=2.0, atol=1e-6, name="gemm M=6")
    msg = str(info.value)
    assert msg.startswith("gemm M=6: 2 of 60 elements differ")
    assert "max |out - ref| = 0.5 over finite elements, at index (2, 7)" in msg
    assert f"(ref={float(ref[2, 7])!r}, got={float(out[2, 7])!r})" in msg
    assert "first mismatches (index: ref, got): (2, 7):" in msg and "(4, 1):" in msg
    assert "tol=" in msg and "c·max|baseline - ref| + atol" in msg


def test_assert_close_just_over_tolerance_fails(rng):
    ref, baseline = _triple(rng)
    tol = 2.0 * np.abs(baseline - ref).max()
    out = ref.copy()
    out[0, 0] += 1.01 * tol
    with pytest.raises(AssertionError, match="1 of 60 elements"):
        assert_close(out, ref, baseline, c=2.0, atol=0.0)


def test_assert_close_nan_and_inf_mismatches(rng):
    ref, baseline = _triple(rng)
    out = ref.copy()
    out[1, 3] = np.nan
    with pytest.raises(AssertionError, match=r"NaN mismatches: 1, first at \(1, 3\)"):
        assert_close(out, ref, baseline)
    ref_nan = ref.copy()
    ref_nan[0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"NaN mismatches: 1, first at \(0, 0\) \(ref=nan, got=-?\d"):
        assert_close(ref.copy(), ref_nan, baseline)
    both = ref_nan.copy()
    assert_close(both, ref_nan, baseline)                     # NaN where the reference has NaN is fine
    out = ref.copy()
    out[5, 9] = np.inf
    with pytest.raises(AssertionError, match="infinity mismatches: 1"):
        assert_close(out, ref, baseline)
    ref_inf = ref.copy()
    ref_inf[5, 9] = -np.inf
    with pytest.raises(AssertionError, match="infinity mismatches: 1"):
        assert_close(out, ref_inf, baseline)
    out_inf = ref_inf.copy()
    assert_close(out_inf, ref_inf, baseline)                  # equal infinities are fine


def test_assert_close_shape_and_rtol(rng):
    ref, baseline = _triple(rng)
    with pytest.raises(AssertionError, match=r"shape \(6, 9\) differs from the reference shape \(6, 10\)"):
        assert_close(ref[:, :9], ref, baseline)
    with pytest.raises(AssertionError, match=r"baseline shape \(6, 9\)"):
        assert_close(ref, ref, baseline[:, :9])
    out = ref + 0.01
    assert_close(out, ref, baseline, atol=0.02)
    with pytest.raises(AssertionError, match="exceeds rtol=0.0001"):
        assert_close(out, ref, baseline, atol=0.02, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------------
# CuPy inputs (runs on the GPU machine)
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_reference_accepts_cupy_inputs(rng):
    import cupy as cp

    K, N, G = 256, 64, 128
    Q, Z, S = _random_logical(rng, K, N, G)
    x = rng.standard_normal((3, K)).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float16)
    dQ, dZ, dS, dx, db = (cp.asarray(a) for a in (Q, Z, S, x, bias))
    W = dequantize(dQ, dZ, dS, G, dtype=np.float16)
    assert isinstance(W, np.ndarray)
    np.testing.assert_array_equal(W.view(np.uint16), dequantize(Q, Z, S, G, dtype=np.float16).view(np.uint16))
    y = matmul(dx, dQ, dZ, dS, G, bias=db)
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(y, matmul(x, Q, Z, S, G, bias=bias))
    packed = {k: cp.asarray(v) for k, v in pack(Q, Z, S, "gemv_fast", G).items()}
    np.testing.assert_array_equal(dequantize_packed(packed, "gemv_fast", K, G),
                                  dequantize_packed({k: cp.asnumpy(v) for k, v in packed.items()},
                                                    "gemv_fast", K, G))
    assert_close(cp.asarray(y), y, y)
    np.testing.assert_array_equal(unpack(packed, "gemv_fast", K, G)[0].get(), Q)
