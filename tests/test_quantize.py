"""quantize(): AutoAWQ pseudo_quantize_tensor semantics, checked against AutoAWQ's own output (golden fixtures)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from awq_cupy import formats
from awq_cupy._array import bfloat16_dtype
from awq_cupy.quantize import QuantizedTensors, quantize

from conftest import FIXTURES

INDEX = json.loads((FIXTURES / "index.json").read_text())
IDS = [e["file"].removesuffix(".safetensors") for e in INDEX]


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def _mismatch_report(got, want):
    """Talking failure message: count, first mismatches with index."""
    bad = np.argwhere(_bits(got) != _bits(want))
    pairs = [(tuple(int(i) for i in ix), float(want[tuple(ix)]), float(got[tuple(ix)])) for ix in bad[:5]]
    return f"{len(bad)} of {got.size} differ; first (index, want, got): {pairs}"


def _check_logical(qt: QuantizedTensors, K, N, G):
    assert qt.group_size == G
    assert qt.Q.dtype == np.uint8 and qt.Q.shape == (K, N) and qt.Q.flags.c_contiguous
    assert qt.Z.dtype == np.uint8 and qt.Z.shape == (K // G, N) and qt.Z.flags.c_contiguous
    assert qt.S.dtype == np.float16 and qt.S.shape == (K // G, N) and qt.S.flags.c_contiguous
    assert int(qt.Q.max()) <= 15 and int(qt.Z.max()) <= 15
    assert np.isfinite(qt.S).all() and (qt.S > 0).all()


@pytest.fixture(scope="module", params=INDEX, ids=IDS)
def golden(request):
    e = request.param
    return e, load_file(FIXTURES / e["file"])


def test_fake_quant_matches_autoawq_bit_for_bit(golden):
    e, t = golden
    K, N, G = e["in_features"], e["out_features"], e["group_size"]
    symmetric = e["format"] == "marlin"
    qt = quantize(t["weight_original"], G, zero_point=not symmetric)
    _check_logical(qt, K, N, K if G == -1 else G)
    got, want = qt.fake_quant(), t["weight_fake_quant"]
    assert got.dtype == np.float16 and got.shape == (N, K) and got.flags.c_contiguous
    if symmetric:
        # AutoAWQ's symmetric path keeps -0.0 where round(w/s) == -0; (Q - Z)*S gives +0.0. Same value.
        want = want + np.float16(0)
    assert np.array_equal(_bits(got), _bits(want)), _mismatch_report(got, want)
    if symmetric:
        assert (qt.Z == 8).all()


def test_pack_reproduces_autoawq_tensors(golden):
    e, t = golden
    qt = quantize(t["weight_original"], e["group_size"], zero_point=e["format"] != "marlin")
    packed = qt.pack(e["format"])
    stored = {k: t[k] for k in ("qweight", "qzeros", "scales") if k in t}
    assert set(packed) == set(stored)
    for name, want in stored.items():
        got = packed[name]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        diff = np.argwhere(got.view(np.uint8).reshape(got.shape[0], -1) != want.view(np.uint8).reshape(got.shape[0], -1))
        assert diff.size == 0, f"{name}: {len(diff)} bytes differ, first at {diff[:3].tolist()}"


def test_unpacked_fixture_equals_quantizer_output(golden):
    """The quantizer's Q/Z/S are exactly what the fixture's packed tensors hold (formats.unpack)."""
    e, t = golden
    qt = quantize(t["weight_original"], e["group_size"], zero_point=e["format"] != "marlin")
    Q, Z, S = formats.unpack(t, e["format"], e["in_features"], e["group_size"])
    assert np.array_equal(Q, qt.Q) and np.array_equal(Z, qt.Z) and np.array_equal(_bits(S), _bits(qt.S))


def _error_bound_check(w, qt):
    """|w - w_fake| <= s/2 (+ slack for the fp16 division and final rounding) for values inside the grid."""
    N, K = w.shape
    G = qt.group_size
    w64 = w.astype(np.float64)
    fake = qt.fake_quant(np.float32).astype(np.float64)
    s = np.repeat(qt.S.T.astype(np.float64), G, axis=1)                  # [N, K]
    z = np.repeat(qt.Z.T.astype(np.float64), G, axis=1)
    lo, hi = -z * s, (15 - z) * s
    inside = (w64 >= lo - s / 2) & (w64 <= hi + s / 2)
    bound = s * (0.5 + 16 * 2.0 ** -11) + np.abs(fake) * 2.0 ** -11 + 1e-12
    err = np.abs(w64 - fake)
    bad = inside & (err > bound)
    assert not bad.any(), (f"{int(bad.sum())} values exceed s/2: worst excess "
                           f"{float((err - bound)[bad].max())} at {np.argwhere(bad)[0].tolist()}")
    return inside


@pytest.mark.parametrize("G", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_error_bound_random(rng, G, zero_point, dtype):
    N, K = 24, 256
    w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 3, size=(N, 1))).astype(dtype)
    w[::5] += dtype(0.5)        # some rows not centred on 0
    qt = quantize(w, G, zero_point=zero_point)
    Gr = K if G == -1 else G
    _check_logical(qt, K, N, Gr)
    inside = _error_bound_check(w, qt)
    assert inside.mean() > 0.99  # random data lies on the grid: the bound must actually be exercised
    if not zero_point:
        assert (qt.Z == 8).all()


def test_group_size_minus_one_equals_k(rng):
    w = rng.standard_normal((16, 192)).astype(np.float16)
    a, b = quantize(w, -1), quantize(w, 192)
    assert a.group_size == b.group_size == 192
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)


def test_odd_group_size_344(rng):
    """Real TP shards produce G = 344 (docs/formats.md §Checkpoint pitfalls); any divisor of K that is a multiple of 8 is accepted."""
    w = rng.standard_normal((8, 688)).astype(np.float16)
    qt = quantize(w, 344)
    _check_logical(qt, 688, 8, 344)
    _error_bound_check(w, qt)


def test_fp32_scale_is_rounded_first_so_qzs_are_self_consistent(rng):
    w = rng.standard_normal((16, 128)).astype(np.float32)
    qt = quantize(w, 64)
    # float32 fake quant is (Q - Z) * S exactly: the scale used for q/z is the stored fp16 scale.
    s32 = qt.S.astype(np.float32)
    Sfull = np.repeat(s32, 64, axis=0)
    Zfull = np.repeat(qt.Z.astype(np.float32), 64, axis=0)
    want = (qt.Q.astype(np.float32) - Zfull) * Sfull
    assert np.array_equal(qt.dequantize(np.float32), want)
    # and q is the nearest code for that scale (independent float64 evaluation)
    w64 = w.T.astype(np.float64)
    q_ref = np.clip(np.rint(w64 / Sfull) + Zfull, 0, 15)
    near_tie = np.abs(np.abs(w64 / Sfull - np.trunc(w64 / Sfull)) - 0.5) < 1e-5
    assert np.array_equal(q_ref[~near_tie], qt.Q.astype(np.float64)[~near_tie])


@pytest.mark.skipif(bfloat16_dtype() is None, reason="ml_dtypes is not installed (bfloat16 input needs it)")
def test_bfloat16_input_equals_float32_of_same_values(rng):
    bf = bfloat16_dtype()
    w = rng.standard_normal((16, 256)).astype(np.float32).astype(bf)
    a, b = quantize(w, 128), quantize(w.astype(np.float32), 128)
    assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))
    out = a.dequantize(bf)
    assert out.dtype == bf and out.shape == (256, 16)


def test_dequantize_dtypes_agree(rng):
    w = rng.standard_normal((8, 128)).astype(np.float16)
    qt = quantize(w, 32)
    w16, w32 = qt.dequantize(np.float16), qt.dequantize(np.float32)
    assert w16.dtype == np.float16 and w32.dtype == np.float32 and w16.shape == w32.shape == (128, 8)
    assert np.array_equal(w16, w32.astype(np.float16))   # float32 (q - z) * s is exact, float16 rounds it once
    with pytest.raises(TypeError, match="float16, float32 or bfloat16"):
        qt.dequantize(np.int32)


# -- degenerate groups ------------------------------------------------------------------------------------------

def test_all_zero_rows_are_exact():
    w = np.zeros((8, 128), np.float16)
    qt = quantize(w, 64)
    _check_logical(qt, 128, 8, 64)
    assert (qt.Q == 0).all() and (qt.Z == 0).all()
    assert np.array_equal(qt.fake_quant(), w)
    sym = quantize(w, 64, zero_point=False)
    assert (sym.Q == 8).all() and np.array_equal(sym.fake_quant(), w)


def test_constant_rows_follow_autoawq_clamping():
    """A constant c != 0 has range 0, so s = fp16(1e-5)/15 and the grid [-z s, (15-z) s] cannot reach c:
    AutoAWQ clamps it to +15 s (c > 0) or -15 s (c < 0). Documented, finite, and reproduced exactly."""
    w = np.empty((16, 128), np.float16)
    w[:8] = np.float16(0.75)
    w[8:] = np.float16(-2.5)
    with np.errstate(all="raise"):               # no floating-point warnings escape quantize
        qt = quantize(w, 128)
    s_min = np.float16(np.float16(1e-5) / np.float16(15))
    assert (qt.S == s_min).all()
    fake = qt.fake_quant()
    assert np.isfinite(fake).all()
    assert (fake[:8] == np.float16(15) * s_min).all() and (fake[8:] == -np.float16(15) * s_min).all()
    assert (qt.Z[:, :8] == 0).all() and (qt.Z[:, 8:] == 15).all()
    # symmetric quantization represents constants well: q = +-7, s = |c| / 7
    sym = quantize(w, 128, zero_point=False).fake_quant()
    assert np.allclose(sym.astype(np.float32), w.astype(np.float32), rtol=2e-3)


def test_tiny_ranges_stay_finite_and_within_bound(rng):
    w = (rng.standard_normal((16, 128)) * 1e-7).astype(np.float32)   # range << 1e-5 clamp
    w[8:] += 3e-6                                                         # off-centre, still inside the grid
    for dtype in (np.float16, np.float32):
        x = w.astype(dtype)
        qt = quantize(x, 64)
        fake = qt.fake_quant(np.float32)
        assert np.isfinite(fake).all() and np.isfinite(qt.S.astype(np.float32)).all()
        inside = _error_bound_check(x, qt)
        assert inside.all()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_codes_and_bound(data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    G = data.draw(st.sampled_from([32, 64, 128]))
    scale = data.draw(st.sampled_from([1e-4, 1e-2, 1.0, 100.0]))
    shift = data.draw(st.sampled_from([0.0, 0.3, -2.0]))
    zp = data.draw(st.booleans())
    r = np.random.default_rng(seed)
    w = (r.standard_normal((8, 256)) * scale + shift * scale).astype(np.float16)
    qt = quantize(w, G, zero_point=zp)
    _check_logical(qt, 256, 8, G)
    _error_bound_check(w, qt)


# -- rejected inputs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, exc, match", [
    (np.float16(np.nan), ValueError, "non-finite"),
    (np.float16(np.inf), ValueError, "non-finite"),
])
def test_rejects_non_finite(rng, bad, exc, match):
    w = rng.standard_normal((8, 128)).astype(np.float16)
    w[3, 77] = bad
    with pytest.raises(exc, match=match):
        quantize(w, 128)


def test_rejects_scale_overflow():
    w = np.zeros((8, 128), np.float16)
    w[0, 0], w[0, 1] = 60000, -60000               # max - min overflows float16
    with pytest.raises(ValueError, match="too large for a float16 scale"):
        quantize(w, 128)
    w32 = np.zeros((8, 128), np.float32)
    w32[0, 0] = 2e6                                 # s = 2e6/15 > 65504
    with pytest.raises(ValueError, match="too large for a float16 scale"):
        quantize(w32, 128)


@pytest.mark.parametrize("shape, G, match", [
    ((12, 128), 128, "multiple of 8"),              # N % 8
    ((8, 96), 64, "not a multiple of group_size"),  # K % G
    ((8, 128), 0, "must be positive"),
    ((8, 128), -2, "must be positive"),
    ((8, 120), 12, "multiple of 8"),                # divisor of K, but not a multiple of 8
])
def test_rejects_bad_shapes(shape, G, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.ones(shape, np.float16), G)


def test_rejects_bad_types():
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.ones(128, np.float16), 128)
    with pytest.raises(TypeError, match="not supported"):
        quantize(np.ones((8, 128), np.int32), 128)
    with pytest.raises(TypeError, match="not supported"):
        quantize(np.ones((8, 128), np.float64), 128)
    with pytest.raises(TypeError, match="zero_point"):
        quantize(np.ones((8, 128), np.float16), 128, zero_point=1)
    with pytest.raises(TypeError, match="numpy or cupy array"):
        quantize([[1.0] * 128] * 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_point", [True, False])
def test_cupy_matches_numpy(zero_point):
    import cupy

    e = INDEX[1]
    t = load_file(FIXTURES / e["file"])
    ref = quantize(t["weight_original"], e["group_size"], zero_point=zero_point)
    got = quantize(cupy.asarray(t["weight_original"]), e["group_size"], zero_point=zero_point)
    assert all(isinstance(a, cupy.ndarray) for a in got[:3])
    for name, a, b in zip("QZS", got[:3], ref[:3]):
        assert np.array_equal(cupy.asnumpy(a).view(np.uint8), b.view(np.uint8)), name
    fake = got.fake_quant()
    assert isinstance(fake, cupy.ndarray)
    assert np.array_equal(_bits(cupy.asnumpy(fake)), _bits(ref.fake_quant()))
    if zero_point:
        assert np.array_equal(_bits(cupy.asnumpy(fake)), _bits(t["weight_fake_quant"]))
