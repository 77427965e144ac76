"""Tests for awq_cupy.formats: golden AutoAWQ fixtures, known-answer words, independent layout oracles,
round trips on real model shapes, detection, converters and input validation."""
import functools
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from awq_cupy import formats as F
from awq_cupy.formats import (FORMATS, ORDER, FormatError, LayerShape, convert, detect_format, infer_shape, pack,
                              packed_shapes, resolve_group_size, to_gemm, unpack, zeros_width)
from awq_cupy.reference import dequantize, dequantize_packed

INDEX = json.loads((FIXTURES / "index.json").read_text())
PACKED_KEYS = ("qweight", "qzeros", "scales", "bias")


# ------------------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _load(file):
    return load_file(str(FIXTURES / file))


def _packed(entry):
    """The layer's on-disk tensors (what a checkpoint holds), without the test-only extras."""
    t = _load(entry["file"])
    return {k: t[k] for k in PACKED_KEYS if k in t}


def _bits(a):
    """Raw bytes of an array as uint8, so comparisons are bit for bit (-0.0 != +0.0, NaN payloads count)."""
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_bits_equal(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.flatnonzero(_bits(got) != _bits(want))
    assert diff.size == 0, f"{what}: {diff.size} differing bytes, first at byte {diff[:5]}"


def _assert_packed_equal(got, want, what):
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for k in want:
        _assert_bits_equal(got[k], want[k], f"{what} {k}")


def _max_ulps_f16(a, b, magnitude=None):
    """Largest distance between two float16 arrays in float16 ulps of ``magnitude`` (default: max(|a|, |b|))."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    if magnitude is None:
        magnitude = np.maximum(np.abs(a32), np.abs(b32))
    ulp = np.spacing(np.asarray(magnitude).astype(np.float16)).astype(np.float32)
    return float(np.max(np.abs(a32 - b32) / ulp))


def _random_logical(rng, K, N, G, *, symmetric=False):
    """Random (Q, Z, S) with scales of both signs and realistic magnitudes (never zero)."""
    NG = K // resolve_group_size(G, K)
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = np.full((NG, N), 8, np.uint8) if symmetric else rng.integers(0, 16, (NG, N), dtype=np.uint8)
    S = (rng.uniform(1e-4, 5e-2, (NG, N)) * rng.choice([-1.0, 1.0], (NG, N))).astype(np.float16)
    return Q, Z, S


def _assert_logical_equal(got, want):
    (Q, Z, S), (Q0, Z0, S0) = got, want
    assert Q.dtype == np.uint8 and Z.dtype == np.uint8 and S.dtype == np.float16, (Q.dtype, Z.dtype, S.dtype)
    np.testing.assert_array_equal(Q, Q0)
    np.testing.assert_array_equal(Z, Z0)
    _assert_bits_equal(S, S0, "S")


# ------------------------------------------------------------------------------------------------------------
# Golden fixtures packed by AutoAWQ
# ------------------------------------------------------------------------------------------------------------

FIXTURE_PARAMS = [pytest.param(e, id=e["file"].removesuffix(".safetensors")) for e in INDEX]


def test_fixture_index_covers_every_format():
    assert {e["format"] for e in INDEX} == set(FORMATS)
    assert any(e["in_features"] == e["out_features"] for e in INDEX if e["format"] == "gemm")
    assert any(e["in_features"] == e["out_features"] for e in INDEX if e["format"] == "gemv")


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
def test_fixture_tensors_match_index(entry):
    t = _load(entry["file"])
    assert set(t) == set(entry["tensors"])
    for name, (dtype, shape) in entry["tensors"].items():
        assert (str(t[name].dtype), list(t[name].shape)) == (dtype, shape), name


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
def test_fixture_detect_and_infer(entry):
    fmt, K, N, G = entry["format"], entry["in_features"], entry["out_features"], entry["group_size"]
    tensors = _packed(entry)
    assert detect_format(tensors, K, N) == fmt
    assert infer_shape(tensors) == LayerShape(fmt, K, N)
    assert infer_shape(tensors, G) == (fmt, K, N)
    assert packed_shapes(fmt, K, N, G) == {k: tuple(v.shape) for k, v in tensors.items() if k != "bias"}


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
def test_fixture_dequantizes_to_fake_quant(entry):
    fmt, K, N, G = entry["format"], entry["in_features"], entry["out_features"], entry["group_size"]
    want = np.ascontiguousarray(_load(entry["file"])["weight_fake_quant"].T)   # [N, K] -> our [K, N]
    Q, Z, S = unpack(_packed(entry), fmt, K, G)
    NG = K // resolve_group_size(G, K)
    assert (Q.shape, Z.shape, S.shape) == ((K, N), (NG, N), (NG, N))
    W = dequantize(Q, Z, S, G, dtype=np.float16)
    if fmt == "marlin":
        # AutoAWQ's symmetric quantizer yields -0.0 where round(w/s) is -0; (Q - Z)·S cannot carry that sign.
        # Adding +0 turns -0 into +0 and changes nothing else, so the rest is still compared bit for bit.
        want = want + np.float16(0)
        assert np.all(Z == 8)
    _assert_bits_equal(W, want, "(Q - Z)·S vs weight_fake_quant")

    W_kernel = dequantize_packed(_packed(entry), fmt, K, G, dtype=np.float16)
    if fmt == "gemv_fast":
        # Q·S + fp16(-S·Z) (spec P10): the rounding of SZ adds half an ulp *of SZ* to the final half ulp, so the
        # bound is one float16 ulp of the larger of |W| and |SZ| (near q = z, |W| is much smaller than |SZ|).
        _, _, SZ = F.unpack_scaled_zeros(_packed(entry), K, G)
        magnitude = np.maximum(np.abs(want), np.abs(SZ[np.arange(K) // resolve_group_size(G, K)]))
        assert _max_ulps_f16(W_kernel, want, magnitude) <= 1.0
        assert not np.array_equal(W_kernel, want)      # the two dequantizations really differ on these files
    else:
        _assert_bits_equal(W_kernel, want, "dequantize_packed vs weight_fake_quant")


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
def test_fixture_repack_is_bit_exact(entry):
    fmt, K, G = entry["format"], entry["in_features"], entry["group_size"]
    tensors = _packed(entry)
    repacked = pack(*unpack(tensors, fmt, K, G), fmt, G)
    _assert_packed_equal(repacked, {k: v for k, v in tensors.items() if k != "bias"}, f"repacked {fmt}")


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
def test_fixture_to_gemm_keeps_weights(entry):
    fmt, K, N, G = entry["format"], entry["in_features"], entry["out_features"], entry["group_size"]
    tensors = _packed(entry)
    g = to_gemm(tensors, fmt, K, G)
    assert set(g) == {"qweight", "qzeros", "scales", "bias"}
    assert g["bias"] is tensors["bias"]
    assert detect_format(g, K, N) == "gemm"
    want = dequantize(*unpack(tensors, fmt, K, G), G, dtype=np.float16)
    _assert_bits_equal(dequantize_packed(g, "gemm", K, G, dtype=np.float16), want, "gemm from " + fmt)


@pytest.mark.parametrize("entry", FIXTURE_PARAMS)
@pytest.mark.parametrize("dst", FORMATS)
def test_fixture_convert_round_trip(entry, dst):
    fmt, K, G = entry["format"], entry["in_features"], entry["group_size"]
    tensors = _packed(entry)
    if dst == "marlin" and fmt != "marlin":
        with pytest.raises(ValueError, match="marlin is symmetric"):
            convert(tensors, fmt, dst, K, G)
        return
    there = convert(tensors, fmt, dst, K, G)
    assert detect_format(there, K, entry["out_features"]) == dst
    back = convert(there, dst, fmt, K, G)
    _assert_packed_equal(back, tensors, f"{fmt} -> {dst} -> {fmt}")


# ------------------------------------------------------------------------------------------------------------
# Known answers and independent layout oracles (docs/formats.md §The gemm layout, §The gemv layout, §The gemv_fast layout, §The marlin layout)
# ------------------------------------------------------------------------------------------------------------

def test_known_answer_gemm(rng):
    Q, Z, S = _random_logical(rng, 32, 16, 32)
    Q[5, 8:16] = np.arange(1, 9)
    words = pack(Q, Z, S, "gemm", 32)["qweight"]
    assert words.dtype == np.int32
    assert int(words.view(np.uint32)[5, 1]) == 0x86427531


def test_known_answer_gemv(rng):
    Q, Z, S = _random_logical(rng, 64, 16, 64)
    Q[8:16, 3] = np.arange(1, 9)
    words = pack(Q, Z, S, "gemv", 64)["qweight"]
    assert words.dtype == np.int32 and words.shape == (16, 8)
    assert int(words.view(np.uint32)[3, 1]) == 0x87654321


def test_known_answer_gemv_fast(rng):
    Q, Z, S = _random_logical(rng, 128, 16, 128)
    Q[:, 0] = np.arange(128) % 16
    qweight = pack(Q, Z, S, "gemv_fast", 128)["qweight"]
    assert qweight.dtype == np.int16 and qweight.shape == (4, 128)
    words = np.ascontiguousarray(qweight[0]).view(np.uint32)
    assert [hex(w) for w in words[:4]] == ["0x91918080", "0xb3b3a2a2", "0xd5d5c4c4", "0xf7f7e6e6"]


def test_gemv_fast_layout_matches_spec_index_formula(rng):
    """Scatter with the spec's e(k, n) nibble index (docs/formats.md §The gemv_fast layout), independently of the transpose in formats.py."""
    K, N = 192, 24
    Q, Z, S = _random_logical(rng, K, N, 64)
    k = np.arange(K)[:, None]
    n = np.arange(N)[None, :]
    t = k % 32
    e = (k // 64) * 256 + (n % 4) * 64 + ((k % 64) // 32) * 32 + 8 * ((t % 8) // 2) + 4 * (t % 2) + t // 8
    nib = np.zeros((N // 4, 4 * K), np.uint16)
    nib[np.broadcast_to(n // 4, (K, N)), e] = Q
    nib = nib.reshape(N // 4, K, 4)
    want = (nib[..., 0] | nib[..., 1] << 4 | nib[..., 2] << 8 | nib[..., 3] << 12).view(np.int16)
    _assert_bits_equal(pack(Q, Z, S, "gemv_fast", 64)["qweight"], want, "gemv_fast qweight")


def test_marlin_layout_matches_spec_word_definition(rng):
    """Every word equals the definition of docs/formats.md §The marlin layout (lane, j -> 8 values in ORDER), spelled out element by element."""
    K, N = 32, 128
    Q, _, S = _random_logical(rng, K, N, -1, symmetric=True)
    words = pack(Q, None, S, "marlin", -1)["qweight"].view(np.uint32)
    assert words.shape == (K // 16, 2 * N)
    for kt in range(K // 16):
        for nt in range(N // 64):
            for lane in range(32):
                for j in range(4):
                    r, c = lane % 4, lane // 4
                    k0, n0 = 16 * kt + 2 * r, 64 * nt + 16 * j + c
                    v = [Q[k0, n0], Q[k0 + 1, n0], Q[k0 + 8, n0], Q[k0 + 9, n0],
                         Q[k0, n0 + 8], Q[k0 + 1, n0 + 8], Q[k0 + 8, n0 + 8], Q[k0 + 9, n0 + 8]]
                    want = sum(int(v[ORDER[i]]) << (4 * i) for i in range(8))
                    assert int(words[kt, 128 * nt + 4 * lane + j]) == want, (kt, nt, lane, j)


def test_marlin_scale_permutations(rng):
    K, N = 256, 128
    Q, _, S = _random_logical(rng, K, N, 128, symmetric=True)
    grouped = pack(Q, None, S, "marlin", 128)["scales"]
    for p in range(64):   # SCALE_PERM[8i + j] = i + 8j inside every 64-column chunk
        i, j = divmod(p, 8)
        np.testing.assert_array_equal(grouped[:, p::64], S[:, i + 8 * j::64])
    Q, _, S = _random_logical(rng, K, N, -1, symmetric=True)
    single = pack(Q, None, S, "marlin", -1)["scales"]
    perm = [2 * i + d for i in range(4) for d in (0, 1, 8, 9, 16, 17, 24, 25)]
    np.testing.assert_array_equal(single, S.reshape(-1, 32)[:, perm].reshape(1, N))


# ------------------------------------------------------------------------------------------------------------
# Group sizes and zero widths
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K, G, ZW", [(4096, 128, 4), (11008, 128, 11), (13824, 128, 14), (11008, 64, 22),
                                      (4096, -1, 1), (4096, 4096, 1), (4096, 32, 16), (4096, 64, 8),
                                      (1408, 128, 2), (96, 32, 4)])
def test_zeros_width_examples(K, G, ZW):
    assert zeros_width(K, G) == ZW


@pytest.mark.parametrize("G", [8, 16, 24, 48, 96])
def test_zeros_width_rejects_group_sizes_without_a_gemv_layout(G):
    with pytest.raises(ValueError, match=f"group_size={G} is not supported by the gemv"):
        zeros_width(96 * 16, G)


def test_resolve_group_size():
    assert resolve_group_size(-1, 4096) == 4096
    assert resolve_group_size(128, 4096) == 128
    assert resolve_group_size(np.int64(64), 4096) == 64
    assert resolve_group_size(100, 100) == 100      # G = K needs no multiple of 8
    assert resolve_group_size(24, 48) == 24         # gemm takes any multiple of 8 that divides K


@pytest.mark.parametrize("G, K, exc, match", [
    (128, 100, ValueError, r"K=100 is not a multiple of group_size=128"),
    (64, 11000, ValueError, r"K=11000 is not a multiple of group_size=64"),
    (0, 128, ValueError, r"group_size=0 must be positive"),
    (-2, 128, ValueError, r"group_size=-2 must be positive"),
    (12, 48, ValueError, r"group_size=12 must be a multiple of 8"),
    (128, 0, ValueError, r"K=0 must be positive"),
    (128.0, 256, TypeError, r"group_size must be an integer"),
    (True, 256, TypeError, r"group_size must be an integer"),
])
def test_resolve_group_size_rejects(G, K, exc, match):
    with pytest.raises(exc, match=match):
        resolve_group_size(G, K)


# ------------------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------------------

ROUND_TRIPS = (
    # real model shapes with padded zero widths (docs/formats.md §Group sizes): 86 and 108 groups of 128, 172 groups of 64
    [(f, 11008, 64, 128) for f in FORMATS]
    + [(f, 13824, 64, 128) for f in FORMATS]
    + [(f, 11008, 16, 64) for f in ("gemm", "gemv", "gemv_fast")]
    # square layers, every standard group size (gemm and gemv qweight shapes coincide)
    + [(f, 256, 256, G) for f in FORMATS for G in (32, 64, 128, -1)]
    # gemm-only generality: G a multiple of 8 but not a power of two; G = K not a multiple of 8
    + [("gemm", 240, 40, 48), ("gemm", 100, 8, -1), ("gemv", 640, 8, 320)]
)


@pytest.mark.parametrize("fmt, K, N, G", ROUND_TRIPS)
def test_round_trip(rng, fmt, K, N, G):
    Q, Z, S = _random_logical(rng, K, N, G, symmetric=(fmt == "marlin"))
    packed = pack(Q, Z, S, fmt, G)
    shapes = packed_shapes(fmt, K, N, G)
    assert {k: tuple(v.shape) for k, v in packed.items()} == shapes
    want_dtypes = {"qweight": np.int16 if fmt == "gemv_fast" else np.int32, "scales": np.float16,
                   "qzeros": np.float16 if fmt == "gemv_fast" else np.int32}
    for k, v in packed.items():
        assert v.dtype == want_dtypes[k], (k, v.dtype)
        assert v.flags.c_contiguous, k
    _assert_logical_equal(unpack(packed, fmt, K, G), (Q, Z, S))
    assert detect_format(packed, K, N) == fmt
    assert infer_shape(packed) == (fmt, K, N)
    assert infer_shape(packed, G) == (fmt, K, N)

    NG = K // resolve_group_size(G, K)
    if fmt == "gemv":                      # padding: zero nibbles and zero scales beyond NG groups
        words = packed["qzeros"].view(np.uint32)
        zeros = ((words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).reshape(N, -1)
        assert not zeros[:, NG:].any() and not packed["scales"][:, NG:].any()
    if fmt == "gemv_fast":
        assert not packed["qzeros"][NG:].any() and not packed["scales"][NG:].any()
        sz32 = -(S.astype(np.float32) * Z.astype(np.float32))
        _assert_bits_equal(packed["qzeros"][:NG], sz32.astype(np.float16), "scaled zeros")


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpack_then_pack_reproduces_arbitrary_words(rng, fmt):
    """Random packed words over the full 32/16-bit range (negative int32 included, P17) survive a round trip."""
    K, N, G = 256, 128, 128
    shapes = packed_shapes(fmt, K, N, G)
    if fmt == "gemv_fast":
        Q, Z, S = _random_logical(rng, K, N, G)
        tensors = pack(Q, Z, S, fmt, G)
        tensors["qweight"] = rng.integers(-2 ** 15, 2 ** 15, shapes["qweight"]).astype(np.int16)
    else:
        Q, Z, S = _random_logical(rng, K, N, G, symmetric=(fmt == "marlin"))
        tensors = pack(Q, Z, S, fmt, G)
        tensors["qweight"] = rng.integers(-2 ** 31, 2 ** 31, shapes["qweight"]).astype(np.int32)
        if fmt == "gemm":
            tensors["qzeros"] = rng.integers(-2 ** 31, 2 ** 31, shapes["qzeros"]).astype(np.int32)
    assert (tensors["qweight"] < 0).any()
    _assert_packed_equal(pack(*unpack(tensors, fmt, K, G), fmt, G), tensors, fmt)


@pytest.mark.parametrize("fmt", ["gemm", "gemv", "marlin"])
def test_uint32_words_read_like_int32(rng, fmt):
    K, N, G = 128, 64, 64
    Q, Z, S = _random_logical(rng, K, N, G, symmetric=(fmt == "marlin"))
    packed = pack(Q, Z, S, fmt, G)
    as_u32 = {k: (v.view(np.uint32) if v.dtype == np.int32 else v) for k, v in packed.items()}
    assert as_u32["qweight"].dtype == np.uint32
    assert detect_format(as_u32, K, N) == fmt
    _assert_logical_equal(unpack(as_u32, fmt, K, G), (Q, Z, S))


def test_format_names_are_case_insensitive(rng):
    Q, Z, S = _random_logical(rng, 128, 64, 128)
    _assert_packed_equal(pack(Q, Z, S, "GEMM", 128), pack(Q, Z, S, "gemm", 128), "GEMM")


def test_marlin_accepts_explicit_symmetric_zeros(rng):
    Q, Z, S = _random_logical(rng, 128, 64, 64, symmetric=True)
    _assert_packed_equal(pack(Q, Z, S, "marlin", 64), pack(Q, None, S, "marlin", 64), "marlin Z=8 vs None")


def test_pack_rounds_float32_scales_to_float16(rng):
    Q, Z, S = _random_logical(rng, 128, 64, 128)
    S32 = S.astype(np.float32) * np.float32(1 + 1e-5)    # not representable: rounds back to S
    _assert_bits_equal(pack(Q, Z, S32, "gemm", 128)["scales"], S, "scales")


@st.composite
def _layer(draw):
    fmt = draw(st.sampled_from(FORMATS))
    K = 64 * draw(st.integers(1, 6))
    G = draw(st.sampled_from([g for g in (32, 64, 128, -1) if g == -1 or K % g == 0]))
    N = (64 if fmt == "marlin" else 8) * draw(st.integers(1, 4))
    return fmt, K, N, G, draw(st.integers(0, 2 ** 32 - 1))


@settings(max_examples=30, deadline=None)
@given(_layer())
def test_round_trip_property(layer):
    fmt, K, N, G, seed = layer
    rng = np.random.default_rng(seed)
    Q, Z, S = _random_logical(rng, K, N, G, symmetric=(fmt == "marlin"))
    packed = pack(Q, Z, S, fmt, G)
    _assert_logical_equal(unpack(packed, fmt, K, G), (Q, Z, S))
    assert infer_shape(packed, G) == (fmt, K, N)
    gemm = to_gemm(packed, fmt, K, G)
    _assert_logical_equal(unpack(gemm, "gemm", K, G), (Q, Z, S))
    _assert_packed_equal(convert(gemm, "gemm", fmt, K, G), packed, f"gemm -> {fmt}")


# ------------------------------------------------------------------------------------------------------------
# gemv_fast zero tensors: names, bf16, float32, recovery checks
# ------------------------------------------------------------------------------------------------------------

def _gemv_fast_bf16(rng, K=256, N=64, G=128):
    """A gemv_fast layer as llm-awq writes it in bf16: scales and scaled_zeros -(S·Z) rounded once to bf16."""
    Q, Z, _ = _random_logical(rng, K, N, G)
    NG = K // G
    ZW = zeros_width(K, G)
    S_bits = F.float32_to_bf16_bits(rng.uniform(1e-3, 5e-2, (NG, N)).astype(np.float32))
    S32 = F.bf16_bits_to_float32(S_bits)
    SZ_bits = F.float32_to_bf16_bits(-(S32 * Z.astype(np.float32)))
    scales = np.zeros((8 * ZW, N), np.uint16)
    szeros = np.zeros((8 * ZW, N), np.uint16)
    scales[:NG], szeros[:NG] = S_bits, SZ_bits
    qweight = pack(Q, Z, S32.astype(np.float16), "gemv_fast", G)["qweight"]
    return {"qweight": qweight, "scales": scales, "scaled_zeros": szeros}, (Q, Z, S32.astype(np.float16))


def test_bf16_bit_helpers_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf, 3.0e38, np.nan], np.float32)
    bits = F.float32_to_bf16_bits(x)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    back = F.bf16_bits_to_float32(bits)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("as_type", ["uint16", "ml_dtypes"])
def test_gemv_fast_bf16_scaled_zeros(rng, as_type):
    tensors, (Q, Z, S) = _gemv_fast_bf16(rng)
    if as_type == "ml_dtypes":
        tensors = {k: (v.view(ml_dtypes.bfloat16) if v.dtype == np.uint16 else v) for k, v in tensors.items()}
    assert detect_format(tensors, 256, 64) == "gemv_fast"
    _assert_logical_equal(unpack(tensors, "gemv_fast", 256, 128), (Q, Z, S))
    # the kernel-side view keeps the stored bf16 values: W = Q·S + SZ
    Qk, S32, SZ32 = F.unpack_scaled_zeros(tensors, 256, 128)
    np.testing.assert_array_equal(Qk, Q)
    np.testing.assert_array_equal(S32, S.astype(np.float32))
    W = dequantize_packed(tensors, "gemv_fast", 256, 128, dtype=np.float32)
    g = np.arange(256) // 128
    np.testing.assert_array_equal(W, Q * S32[g] + SZ32[g])


def test_gemv_fast_zero_tensor_names_and_float32(rng):
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    packed = pack(Q, Z, S, "gemv_fast", 128)
    llm_awq = {"qweight": packed["qweight"], "scales": packed["scales"], "scaled_zeros": packed["qzeros"]}
    _assert_logical_equal(unpack(llm_awq, "gemv_fast", 256, 128), (Q, Z, S))
    wide = {"qweight": packed["qweight"], "scales": packed["scales"].astype(np.float32),
            "qzeros": -(S.astype(np.float32) * Z)}
    wide["qzeros"] = np.concatenate([wide["qzeros"], np.zeros((6, 64), np.float32)])
    _assert_logical_equal(unpack(wide, "gemv_fast", 256, 128), (Q, Z, S))
    both = dict(llm_awq, qzeros=packed["qzeros"])
    with pytest.raises(FormatError, match="both 'qzeros' and 'scaled_zeros'"):
        unpack(both, "gemv_fast", 256, 128)


def test_gemv_fast_rejects_zeros_that_are_not_integer_multiples(rng):
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    Z[0, 5] = 7
    packed = pack(Q, Z, S, "gemv_fast", 128)
    bits = packed["qzeros"].view(np.uint16)
    bits[0, 5] += 1                                   # one ulp away from -(S·Z)
    with pytest.raises(FormatError, match=r"zeros at group/column \(0, 5\) are not -\(S·Z\)"):
        unpack(packed, "gemv_fast", 256, 128)
    _assert_logical_equal(unpack(packed, "gemv_fast", 256, 128, strict=False), (Q, Z, S))
    packed["qzeros"][0, 5] = 8.0                      # positive SZ with S = 1: Z would be -8
    packed["scales"][0, 5] = 1.0
    with pytest.raises(FormatError, match="integer Z in 0..15"):
        unpack(packed, "gemv_fast", 256, 128)
    Zl = unpack(packed, "gemv_fast", 256, 128, strict=False)[1]
    assert Zl[0, 5] == 0                               # clamped to the nearest code


def test_gemv_fast_zero_scale_guard(rng):
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    S[1, 3] = 0
    packed = pack(Q, Z, S, "gemv_fast", 128)
    Z0 = unpack(packed, "gemv_fast", 256, 128)[1]
    assert Z0[1, 3] == 0                               # no division by zero, no warning-turned-garbage
    packed["qzeros"][1, 3] = np.float16(-0.5)
    with pytest.raises(FormatError, match=r"group \(1, 3\) has scale 0 but scaled zero -0.5"):
        unpack(packed, "gemv_fast", 256, 128)


def test_bf16_scales_outside_float16_raise(rng):
    tensors, _ = _gemv_fast_bf16(rng)
    tensors["scales"][0, 0] = F.float32_to_bf16_bits(np.array([2.0 ** 20], np.float32))[0]
    tensors["scaled_zeros"][0, 0] = F.float32_to_bf16_bits(np.array([0.0], np.float32))[0]
    with pytest.raises(ValueError, match=r"value 1048576.0 at index \(0, 0\) is not exactly representable"):
        unpack(tensors, "gemv_fast", 256, 128)


# ------------------------------------------------------------------------------------------------------------
# Detection
# ------------------------------------------------------------------------------------------------------------

def test_detect_square_layers_by_scales(rng):
    Q, Z, S = _random_logical(rng, 512, 512, 64)
    gemm, gemv = pack(Q, Z, S, "gemm", 64), pack(Q, Z, S, "gemv", 64)
    assert gemm["qweight"].shape == gemv["qweight"].shape
    assert detect_format(gemm, 512, 512) == "gemm"
    assert detect_format(gemv, 512, 512) == "gemv"


def test_detect_reports_observed_shapes(rng):
    Q, Z, S = _random_logical(rng, 256, 128, 128)
    gemm = pack(Q, Z, S, "gemm", 128)
    with pytest.raises(FormatError, match=r"K=512, N=128 from qweight int32 \(256, 16\).*look like gemm with "
                                          r"in_features=256, out_features=128"):
        detect_format(gemm, 512, 128)
    exllama = dict(gemm, qweight=np.zeros((32, 128), np.int32))
    with pytest.raises(FormatError, match="exllama"):
        detect_format(exllama, 256, 128)
    with pytest.raises(TypeError, match="tensors must map names to arrays"):
        detect_format(dict(gemm, qweight=gemm["qweight"].tolist()), 256, 128)
    with pytest.raises(FormatError, match="no 'qweight' tensor"):
        detect_format({"weight": np.zeros((128, 256), np.float16)}, 256, 128)
    with pytest.raises(FormatError, match="match no AWQ format"):
        infer_shape(dict(gemm, qweight=gemm["qweight"].astype(np.float32)))
    with pytest.raises(FormatError, match="match no AWQ format"):
        infer_shape(dict(gemm, scales=gemm["scales"][:, :64]))


def test_infer_shape_with_group_size_validates(rng):
    Q, Z, S = _random_logical(rng, 256, 128, 128)
    gemv = pack(Q, Z, S, "gemv", 128)
    assert infer_shape(gemv) == ("gemv", 256, 128)
    with pytest.raises(FormatError, match=r"gemv qzeros has shape \(128, 1\), expected \(128, 2\)"):
        infer_shape(gemv, 64)                      # G=64 pads zeros to 2 words
    with pytest.raises(TypeError, match="gemv qzeros must be int32"):
        infer_shape(dict(gemv, qzeros=gemv["qzeros"].astype(np.int64)), 128)


# ------------------------------------------------------------------------------------------------------------
# Validation of logical inputs
# ------------------------------------------------------------------------------------------------------------

def _bad_pack_cases():
    rng = np.random.default_rng(1234)
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    Q16 = Q.copy()
    Q16[3, 5] = 16
    Qneg = Q.astype(np.int8)
    Qneg[7, 1] = -1
    Zbad = Z.copy()
    Zbad[1, 2] = 200
    Zasym = np.full_like(Z, 8)
    Zasym[0, 9] = 7
    return [
        ((Q[:100], Z, S, "gemm", 128), ValueError, r"K=100 is not a multiple of group_size=128"),
        ((Q[:, :12], Z[:, :12], S[:, :12], "gemm", 128), ValueError, r"N=12 .*is not a multiple of 8"),
        ((Q16, Z, S, "gemm", 128), ValueError, r"Q must hold unsigned 4-bit values 0..15; found 16 at index \(3, 5\)"),
        ((Qneg, Z, S, "gemv", 128), ValueError, r"found -1 at index \(7, 1\)"),
        ((Q, Zbad, S, "gemm", 128), ValueError, r"Z must hold unsigned 4-bit values 0..15; found 200"),
        ((Q.astype(np.float16), Z, S, "gemm", 128), TypeError, r"Q must be an integer array .* got dtype float16"),
        ((Q, Z.astype(np.float32), S, "gemm", 128), TypeError, r"Z must be an integer array"),
        ((Q, Z, S.astype(np.int32), "gemm", 128), TypeError, r"S must be a floating-point array"),
        ((Q, Z, S[:1], "gemm", 128), ValueError, r"S has shape \(1, 64\), expected \[K/G, N\] = \(2, 64\)"),
        ((Q, Z[:, :32], S, "gemm", 128), ValueError, r"Z has shape \(2, 32\), expected"),
        ((Q, Z, S, "gemm", 64), ValueError, r"S has shape \(2, 64\), expected \[K/G, N\] = \(4, 64\)"),
        ((Q.ravel(), Z, S, "gemm", 128), ValueError, r"Q must be 2-D"),
        ((Q, None, S, "gemm", 128), ValueError, r"Z is required"),
        ((Q, Z, S, "awq", 128), ValueError, r"unknown AWQ format 'awq'"),
        ((Q, Zasym, S, "marlin", 128), ValueError, r"marlin is symmetric: .* found 7 at index \(0, 9\)"),
        ((Q[:, :32], None, S[:, :32], "marlin", 128), ValueError, r"N=32 is not a multiple of 64"),
        ((Q[:40], None, S[:1], "marlin", -1), ValueError, r"K=40 is not a multiple of 16"),
        ((Q[:96], Z.repeat(2, 0)[:3], S.repeat(2, 0)[:3], "gemv_fast", 32), ValueError,
         r"K=96 is not a multiple of 64"),
        ((Q, np.zeros((16, 64), np.uint8), S.repeat(8, 0), "gemv", 16), ValueError,
         r"group_size=16 is not supported by the gemv"),
        ((Q[:100], Z[:1], S[:1], "gemv", -1), ValueError, r"K=100 is not a multiple of 8"),
    ]


@pytest.mark.parametrize("args, exc, match", _bad_pack_cases())
def test_pack_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        pack(*args)


# ------------------------------------------------------------------------------------------------------------
# Validation of packed inputs
# ------------------------------------------------------------------------------------------------------------

def _bad_unpack_cases():
    rng = np.random.default_rng(99)
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    gemm = pack(Q, Z, S, "gemm", 128)
    gemv = pack(Q, Z, S, "gemv", 128)
    gf = pack(Q, Z, S, "gemv_fast", 128)
    return [
        (dict(gemm, qweight=gemm["qweight"].astype(np.int64)), "gemm", 256, 128, TypeError,
         r"gemm qweight must be int32 \(or uint32\) packed words, got int64"),
        (dict(gemm, qzeros=gemm["qzeros"].astype(np.float32)), "gemm", 256, 128, TypeError,
         r"gemm qzeros must be int32"),
        (dict(gemm, scales=gemm["scales"].astype(np.int32)), "gemm", 256, 128, TypeError,
         r"gemm scales must be float16, bfloat16 .* got int32"),
        (dict(gf, qweight=gf["qweight"].astype(np.int32)), "gemv_fast", 256, 128, TypeError,
         r"gemv_fast qweight must be int16"),
        (dict(gf, qzeros=gf["qzeros"].astype(np.int32)), "gemv_fast", 256, 128, TypeError,
         r"gemv_fast qzeros must be float16"),
        (dict(gemm, qzeros=gemm["qzeros"][:1]), "gemm", 256, 128, FormatError,
         r"gemm qzeros has shape \(1, 8\), expected \(2, 8\) for K=256, N=64, group_size=128"),
        (dict(gemv, scales=gemv["scales"][:, :4]), "gemv", 256, 128, FormatError,
         r"gemv scales has shape \(64, 4\), expected \(64, 8\)"),
        (dict(gf, qzeros=gf["qzeros"][:4]), "gemv_fast", 256, 128, FormatError,
         r"gemv_fast qzeros has shape \(4, 64\), expected \(8, 64\)"),
        ({"qweight": gemm["qweight"], "scales": gemm["scales"]}, "gemm", 256, 128, FormatError,
         r"missing \['qzeros'\]"),
        ({"qweight": gf["qweight"], "scales": gf["scales"]}, "gemv_fast", 256, 128, FormatError,
         r"'qzeros' or 'scaled_zeros'"),
        (gemm, "gemm", 512, 128, FormatError, r"gemm qweight has shape \(256, 8\), expected \(512, 8\)"),
        (gemm, "gemm", 200, 128, ValueError, r"K=200 is not a multiple of group_size=128"),
        (gemm, "gemv", 256, 128, FormatError, r"gemv qweight has shape \(256, 8\), expected \(256, 32\)"),
        (dict(gemm, qweight=gemm["qweight"].ravel()), "gemm", 256, 128, FormatError, r"must be 2-D"),
        ([gemm["qweight"]], "gemm", 256, 128, TypeError, r"tensors must be a mapping"),
    ]


@pytest.mark.parametrize("tensors, fmt, K, G, exc, match", _bad_unpack_cases())
def test_unpack_rejects(tensors, fmt, K, G, exc, match):
    with pytest.raises(exc, match=match):
        unpack(tensors, fmt, K, G)


def test_converters_reject_bad_formats(rng):
    Q, Z, S = _random_logical(rng, 256, 64, 128)
    gemm = pack(Q, Z, S, "gemm", 128)
    with pytest.raises(ValueError, match="unknown AWQ format 'exllama'"):
        convert(gemm, "gemm", "exllama", 256, 128)
    with pytest.raises(TypeError, match="fmt must be a string"):
        to_gemm(gemm, None, 256, 128)


# ------------------------------------------------------------------------------------------------------------
# CuPy arrays in, CuPy arrays out (runs on the GPU machine)
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cupy_inputs_match_numpy(rng, fmt):
    import cupy as cp

    K, N, G = 11008, 64, 128
    Q, Z, S = _random_logical(rng, K, N, G, symmetric=(fmt == "marlin"))
    want = pack(Q, Z, S, fmt, G)
    got = pack(cp.asarray(Q), cp.asarray(Z), cp.asarray(S), fmt, G)
    assert set(got) == set(want)
    for k in want:
        assert isinstance(got[k], cp.ndarray), k
        _assert_bits_equal(cp.asnumpy(got[k]), want[k], f"cupy {fmt} {k}")
    assert detect_format(got, K, N) == fmt
    assert infer_shape(got, G) == (fmt, K, N)
    out = unpack(got, fmt, K, G)
    assert all(isinstance(a, cp.ndarray) for a in out)
    _assert_logical_equal(tuple(cp.asnumpy(a) for a in out), (Q, Z, S))
    gemm = to_gemm(got, fmt, K, G)
    assert all(isinstance(a, cp.ndarray) for a in gemm.values())
    _assert_packed_equal({k: cp.asnumpy(v) for k, v in gemm.items()}, to_gemm(want, fmt, K, G), "cupy to_gemm")


@pytest.mark.gpu
def test_cupy_gemv_fast_bf16_bits(rng):
    import cupy as cp

    tensors, (Q, Z, S) = _gemv_fast_bf16(rng)
    out = unpack({k: cp.asarray(v) for k, v in tensors.items()}, "gemv_fast", 256, 128)
    assert all(isinstance(a, cp.ndarray) for a in out)
    _assert_logical_equal(tuple(cp.asnumpy(a) for a in out), (Q, Z, S))
    x = cp.asarray(rng.standard_normal(64).astype(np.float32))
    np.testing.assert_array_equal(cp.asnumpy(F.float32_to_bf16_bits(x)), F.float32_to_bf16_bits(cp.asnumpy(x)))
