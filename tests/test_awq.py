"""awq_cupy.awq: the activation-aware search (scales, clipping), the folding helpers and their input checks.

The losses are checked against the layer outputs computed directly (x @ W^T on every token), not against the
module's own Gram-matrix shortcut; AWQ's gain is checked on held-out tokens drawn like the calibration ones.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from awq_cupy import awq, load_checkpoint, quantize, save_checkpoint
from awq_cupy.quantize import QuantizedTensors


def outlier_data(rng, T, K, N, n_layers=1, n_outliers=8, boost=30.0):
    """Activations with a few large input channels (AWQ's premise) and Gaussian weights [N, K] per layer."""
    channel = np.ones(K, np.float32)
    channel[rng.choice(K, n_outliers, replace=False)] = boost
    x = (rng.standard_normal((T, K)) * channel).astype(np.float32)
    ws = [(rng.standard_normal((N, K)) * 0.02).astype(np.float32) for _ in range(n_layers)]
    return x, ws, channel


def direct_mse(x, w, w_hat):
    """Mean squared error of the outputs, the plain way: every token times both weights, float64."""
    x64 = x.astype(np.float64)
    return float(((x64 @ w_hat.astype(np.float64).T - x64 @ w.astype(np.float64).T) ** 2).mean())


def awq_weight(layer: QuantizedTensors, scales):
    """The effective float weight of an AWQ layer: RTN(W diag(s)) diag(1/s), [N, K]."""
    return layer.fake_quant(np.float32) / scales


def rtn_weight(w, G, zero_point=True):
    return quantize(w, G, zero_point=zero_point).fake_quant(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# The search does what AWQ promises

@pytest.mark.parametrize("K,N,G", [(512, 256, 128), (384, 128, 64), (256, 64, -1)])
def test_awq_beats_rtn_on_held_out_tokens(rng, K, N, G):
    x, (w,), _ = outlier_data(rng, 3000, K, N)
    x_calib, x_test = x[:2000], x[2000:]
    res = awq.quantize_awq(w, x_calib, group_size=G)
    got = direct_mse(x_test, w, awq_weight(res.layers[0], res.scales))
    rtn = direct_mse(x_test, w, rtn_weight(w, G))
    assert got < 0.6 * rtn, f"AWQ output MSE {got:.4e} is not clearly below RTN's {rtn:.4e} (alpha={res.alpha})"
    assert res.alpha > 0, res.losses


def test_scaling_alone_and_clipping_alone_each_help(rng):
    x, (w,), _ = outlier_data(rng, 2000, 256, 128)
    G = 128
    rtn = direct_mse(x, w, rtn_weight(w, G))
    scaled = awq.quantize_awq(w, x, group_size=G, clip=False)
    assert scaled.clips == [None]
    e_scaled = direct_mse(x, w, awq_weight(scaled.layers[0], scaled.scales))
    clip = awq.search_clip(w, x, group_size=G)
    e_clip = direct_mse(x, w, awq.quantize_clipped(w, clip, group_size=G).fake_quant(np.float32))
    full = awq.quantize_awq(w, x, group_size=G)
    e_full = direct_mse(x, w, awq_weight(full.layers[0], full.scales))
    assert e_scaled < rtn and e_clip < rtn and e_full <= e_scaled, (rtn, e_scaled, e_clip, e_full)


def test_scale_losses_are_the_output_mse(rng):
    x, ws, _ = outlier_data(rng, 700, 256, 64, n_layers=2)
    G = 64
    alphas = [0.0, 0.25, 0.6]
    losses = awq.scale_losses(ws, x, alphas, group_size=G)
    assert losses.shape == (3,) and losses.dtype == np.float64
    x_mean = np.abs(x).mean(axis=0)
    for a, got in zip(alphas, losses):
        s = np.maximum(x_mean ** a, 1e-4)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        want = np.mean([direct_mse(x, w, quantize(w * s, G).fake_quant(np.float32) / s) for w in ws])
        assert got == pytest.approx(want, rel=2e-4), (a, got, want)
    rtn = np.mean([direct_mse(x, w, rtn_weight(w, G)) for w in ws])
    assert losses[0] == pytest.approx(rtn, rel=2e-4), "alpha = 0 must be plain RTN"


def test_search_scales_picks_the_grid_minimum(rng):
    x, ws, channel = outlier_data(rng, 1000, 256, 64, n_layers=3)
    s = awq.search_scales(ws, x, group_size=128, n_grid=10)
    assert s.shape == (256,) and s.dtype == np.float32 and bool((s > 0).all())
    assert float(np.sqrt(s.max() * s.min())) == pytest.approx(1.0, rel=1e-5), "scales are normalised"
    losses = awq.scale_losses(ws, x, np.arange(10) / 10, group_size=128)
    best = int(np.argmin(losses))
    assert best > 0, losses
    want = np.maximum(np.abs(x).mean(axis=0) ** (best / 10), 1e-4)
    assert np.allclose(s, want / np.sqrt(want.max() * want.min()), rtol=1e-5), "s is the best grid candidate"
    # the outlier channels get the largest scales (their weights are protected)
    assert set(np.argsort(s)[-8:]) == set(np.flatnonzero(channel > 1))


def test_duo_scaling_divides_by_the_weight_term(rng):
    x, ws, _ = outlier_data(rng, 400, 128, 32, n_layers=2)
    s = awq.search_scales(ws, x, group_size=64, n_grid=1, duo_scaling=True)     # the grid is alpha = 0 only
    a = np.abs(np.concatenate(ws)).reshape(-1, 64).astype(np.float64)
    w_mean = (a / (a.max(axis=1, keepdims=True) + 1e-6)).reshape(64, 128).mean(axis=0)
    want = np.maximum(1 / (w_mean + 1e-4), 1e-4)
    assert np.allclose(s, want / np.sqrt(want.max() * want.min()), rtol=1e-5)
    res = awq.quantize_awq(ws, x, group_size=64, duo_scaling=True)
    for w, layer in zip(ws, res.layers):
        assert direct_mse(x, w, awq_weight(layer, res.scales)) < direct_mse(x, w, rtn_weight(w, 64))


def test_quantize_awq_shares_scales_across_layers(rng):
    x, ws, _ = outlier_data(rng, 1500, 256, 64, n_layers=3)
    res = awq.quantize_awq(ws, x, group_size=64, clip=[True, False, True])
    assert len(res.layers) == 3 and res.scales.shape == (256,)
    assert [c is None for c in res.clips] == [False, True, False]
    assert res.losses.shape == (20,) and res.alpha == float(np.argmin(res.losses)) / 20
    for w, layer, c in zip(ws, res.layers, res.clips):
        assert isinstance(layer, QuantizedTensors) and layer.Q.shape == (256, 64) and layer.group_size == 64
        want = awq.quantize_clipped(w * res.scales, c, group_size=64)
        for a, b in zip(layer[:3], want[:3]):
            assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Clipping and RTN with explicit ranges

@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("G", [32, 128])
def test_fake_quant_is_quantize_bit_for_bit(rng, zero_point, G):
    w = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    want = quantize(w, G, zero_point=zero_point).fake_quant(np.float32)
    got = awq._fake_quant(np, w.reshape(64, 256 // G, G), zero_point).reshape(64, 256)
    # + 0 maps -0.0 (symmetric round(w/s) == -0) to +0.0, as (Q - Z) * S gives
    bits_got, bits_want = (got + np.float32(0)).view(np.uint32), (want + np.float32(0)).view(np.uint32)
    bad = np.argwhere(bits_got != bits_want)
    assert len(bad) == 0, f"{len(bad)} differ; first (index, want, got): " + str(
        [(tuple(i), float(want[tuple(i)]), float(got[tuple(i)])) for i in bad[:3]])


@pytest.mark.parametrize("zero_point", [True, False])
def test_search_clip_ranges(rng, zero_point):
    x, (w,), _ = outlier_data(rng, 800, 256, 64)
    G = 64
    clip = awq.search_clip(w, x, group_size=G, n_grid=20, max_shrink=0.5, zero_point=zero_point)
    assert isinstance(clip, awq.ClipRange)
    w3 = w.reshape(64, 4, G)
    top, bottom = (w3.max(-1), w3.min(-1)) if zero_point else (np.abs(w3).max(-1), -np.abs(w3).max(-1))
    for v in clip:
        assert v.shape == (64, 4) and v.dtype == np.float32
    r = clip.max_val / top
    assert bool(np.isin(np.round(r * 20), np.arange(11, 21)).all()), "shrink factors come from the grid"
    assert np.allclose(clip.min_val, bottom * r, rtol=1e-6) and bool((r < 1).any())
    # per group, the chosen range's output error is no worse than no clipping (direct computation)
    xg = x.reshape(-1, 4, G).astype(np.float64)

    def group_errors(w_hat):
        d = (w_hat - w).reshape(64, 4, G).astype(np.float64)
        return (np.einsum("tgk,ngk->tng", xg, d) ** 2).mean(axis=0)

    e_clip = group_errors(awq.quantize_clipped(w, clip, group_size=G, zero_point=zero_point).fake_quant(np.float32))
    e_plain = group_errors(rtn_weight(w, G, zero_point))
    worse = e_clip > e_plain * (1 + 1e-4) + 1e-12
    assert not worse.any(), f"{int(worse.sum())} groups got worse, max by {float((e_clip - e_plain).max()):.3e}"
    assert float(e_clip.sum()) < 0.95 * float(e_plain.sum())


def test_no_shrink_is_no_clipping(rng):
    x, (w,), _ = outlier_data(rng, 300, 128, 32)
    clip = awq.search_clip(w, x, group_size=64, max_shrink=0.0)
    w3 = w.reshape(32, 2, 64)
    assert np.array_equal(clip.max_val, w3.max(-1)) and np.array_equal(clip.min_val, w3.min(-1))
    got = awq.quantize_clipped(w, clip, group_size=64)
    want = quantize(w, 64)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3]))


def test_quantize_clipped_uses_the_ranges(rng):
    w = rng.standard_normal((16, 128)).astype(np.float32)
    w3 = w.reshape(16, 2, 64)
    clip = awq.ClipRange(w3.max(-1) * np.float32(0.7), w3.min(-1) * np.float32(0.6))
    qt = awq.quantize_clipped(w, clip, group_size=64)
    want = quantize(np.clip(w3, clip.min_val[..., None], clip.max_val[..., None]).reshape(16, 128), 64)
    assert all(np.array_equal(a, b) for a, b in zip(qt[:3], want[:3]))
    wq = qt.fake_quant(np.float32).reshape(16, 2, 64)
    step = qt.S.astype(np.float32).T[..., None]
    assert bool((wq <= clip.max_val[..., None] + step).all() and (wq >= clip.min_val[..., None] - step).all())


# ---------------------------------------------------------------------------------------------------------------
# Calibration statistics: cap, determinism, streaming

def test_calibration_stats_subsample_is_deterministic_and_capped(rng):
    x = rng.standard_normal((5000, 64)).astype(np.float32)
    a = awq.calibration_stats(x, max_tokens=1000, seed=3)
    b = awq.calibration_stats(x, max_tokens=1000, seed=3)
    c = awq.calibration_stats(x, max_tokens=1000, seed=4)
    assert a.n_tokens == 1000 and a.gram.shape == (64, 64) and a.gram.dtype == np.float32
    assert np.array_equal(a.gram, b.gram) and np.array_equal(a.x_abs_mean, b.x_abs_mean)
    assert not np.array_equal(a.gram, c.gram)
    rows = np.sort(np.random.default_rng(3).choice(5000, 1000, replace=False))   # the documented rule
    xs = x[rows].astype(np.float64)
    assert np.allclose(a.gram, xs.T @ xs / 1000, rtol=1e-4, atol=1e-5)
    assert np.allclose(a.x_abs_mean, np.abs(xs).mean(0), rtol=1e-5)
    full = awq.calibration_stats(x, max_tokens=5000)
    assert full.n_tokens == 5000


def test_calibration_chunks_equal_one_array(rng):
    x = rng.standard_normal((3, 400, 96)).astype(np.float16)
    one = awq.calibration_stats(x, max_tokens=700, seed=1)
    parts = awq.calibration_stats([x[0], x[1:2], x[2]], max_tokens=700, seed=1)
    assert one.n_tokens == parts.n_tokens == 700
    assert np.allclose(one.gram, parts.gram, rtol=1e-5, atol=1e-6)
    assert np.allclose(one.x_abs_mean, parts.x_abs_mean, rtol=1e-6)


def test_quantize_awq_is_deterministic(rng):
    x, ws, _ = outlier_data(rng, 3000, 128, 32, n_layers=2)
    runs = [awq.quantize_awq(ws, x, group_size=64, max_tokens=1000, seed=7) for _ in range(2)]
    assert np.array_equal(runs[0].scales, runs[1].scales)
    for a, b in zip(runs[0].layers, runs[1].layers):
        assert all(np.array_equal(u, v) for u, v in zip(a[:3], b[:3]))


def test_scaled_stats_are_the_stats_of_scaled_input(rng):
    x = rng.standard_normal((500, 32)).astype(np.float32)
    s = rng.uniform(0.5, 2.0, 32).astype(np.float32)
    got = awq.calibration_stats(x).scaled(s)
    want = awq.calibration_stats(x / s)
    assert np.allclose(got.gram, want.gram, rtol=1e-5, atol=1e-6)
    assert np.allclose(got.x_abs_mean, want.x_abs_mean, rtol=1e-5)


def test_output_mse_and_progress(rng):
    x, (w,), _ = outlier_data(rng, 600, 128, 32)
    wh = rtn_weight(w, 64)
    assert awq.output_mse(w, wh, x) == pytest.approx(direct_mse(x, w, wh), rel=1e-4)
    calls = []
    awq.quantize_awq(w, x, group_size=64, n_grid=5, progress=lambda d, t, desc: calls.append((d, t, desc)))
    assert calls[:5] == [(i, 5, "AWQ scale search, alpha") for i in range(1, 6)]
    assert calls[-1][0] == calls[-1][1] and "clip" in calls[-1][2]


def test_result_writes_a_gemm_checkpoint(rng, tmp_path):
    x, ws, _ = outlier_data(rng, 500, 256, 64, n_layers=2)
    res = awq.quantize_awq(ws, x, group_size=128)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    save_checkpoint(tmp_path / "ckpt", dict(zip(names, res.layers)), group_size=128)
    with load_checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.quant_config.version == "gemm" and ckpt.quant_config.group_size == 128
        for n, layer in zip(names, res.layers):
            assert ckpt.layers[n].format == "gemm"
            got = ckpt.layers[n].unpack()
            assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got[:3], layer[:3]))


# ---------------------------------------------------------------------------------------------------------------
# Folding 1/s upstream keeps the function

def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    out = (x - mu) / np.sqrt(var + eps) * w
    return out if b is None else out + b


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fold_into_norm_keeps_the_layer(rng, kind):
    K, N = 96, 40
    x = rng.standard_normal((50, K)).astype(np.float32) * 3
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32) if kind == "layernorm" else None
    w = rng.standard_normal((N, K)).astype(np.float32)
    s = rng.uniform(0.1, 10, K).astype(np.float32)
    g2, b2 = awq.fold_scales_into_norm(g, b, s)
    assert g2.dtype == np.float32 and (b2 is None) == (b is None)
    norm = (lambda v, gg, bb: layer_norm(v, gg, bb)) if kind == "layernorm" else (lambda v, gg, bb: rms_norm(v, gg))
    want = norm(x, g, b) @ w.T
    got = norm(x, g2, b2) @ (w * s).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max()), np.abs(got - want).max()


def test_fold_into_linear_keeps_the_layer(rng):
    K0, K, N = 48, 64, 24
    x = rng.standard_normal((30, K0)).astype(np.float32)
    w0, b0 = rng.standard_normal((K, K0)).astype(np.float32), rng.standard_normal(K).astype(np.float32)
    w1 = rng.standard_normal((N, K)).astype(np.float32)
    s = rng.uniform(0.1, 10, K).astype(np.float32)
    w0f, b0f = awq.fold_scales_into_linear(w0, b0, s)
    want = (x @ w0.T + b0) @ w1.T
    got = (x @ w0f.T + b0f) @ (w1 * s).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max()), np.abs(got - want).max()
    w0n, none = awq.fold_scales_into_linear(w0, None, s)
    assert none is None and np.array_equal(w0n, w0f)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.floats(0.01, 100), st.sampled_from([np.float16, np.float32]))
def test_fold_keeps_dtype_and_divides(K, scale, dtype):
    r = np.random.default_rng(K)
    w = r.standard_normal(K).astype(dtype)
    s = (r.uniform(0.5, 2.0, K) * scale).astype(np.float32)
    got, _ = awq.fold_scales_into_norm(w, None, s)
    assert got.dtype == dtype and got.shape == (K,)
    assert np.array_equal(got, (w.astype(np.float32) / s).astype(dtype))
    m = r.standard_normal((K, 3)).astype(dtype)
    got2, _ = awq.fold_scales_into_linear(m, None, s)
    assert got2.dtype == dtype and np.array_equal(got2, (m.astype(np.float32) / s[:, None]).astype(dtype))


# ---------------------------------------------------------------------------------------------------------------
# Bad input

def test_bad_inputs_are_rejected(rng):
    x = rng.standard_normal((100, 128)).astype(np.float32)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="first weight has K=128"):
        awq.search_scales([w, w[:, :64]], x, group_size=64)
    with pytest.raises(ValueError, match="expected K=128"):
        awq.search_scales(w, x[:, :64], group_size=64)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        awq.search_scales(w, x, group_size=96)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        awq.quantize_awq(w[:30], x, group_size=64)
    with pytest.raises(TypeError, match="float array"):
        awq.search_scales(w, x.astype(np.int32), group_size=64)
    with pytest.raises(TypeError, match="x_calib must be"):
        awq.search_scales(w, "tokens", group_size=64)
    with pytest.raises(ValueError, match="at least 2-D"):
        awq.search_scales(w, x[0], group_size=64)
    with pytest.raises(ValueError, match="no calibration rows"):
        awq.search_scales(w, x[:0], group_size=64)
    bad = x.copy()
    bad[3, 5] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        awq.search_scales(w, bad, group_size=64)
    wbad = w.copy()
    wbad[0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        awq.quantize_awq(wbad, x, group_size=64)
    with pytest.raises(TypeError, match="weight must be a 2-D"):
        awq.search_clip([w, w], x, group_size=64)
    with pytest.raises(ValueError, match="max_shrink"):
        awq.search_clip(w, x, group_size=64, max_shrink=1.0)
    with pytest.raises(ValueError, match="n_grid"):
        awq.search_scales(w, x, group_size=64, n_grid=0)
    with pytest.raises(ValueError, match="max_tokens"):
        awq.calibration_stats(x, max_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        awq.calibration_stats(x, seed=-1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        awq.search_scales(w, x, groupsize=64)
    with pytest.raises(TypeError, match="list of 1 bools"):
        awq.quantize_awq(w, x, group_size=64, clip=[True, False])
    with pytest.raises(ValueError, match="alphas"):
        awq.scale_losses(w, x, [1.5], group_size=64)
    with pytest.raises(ValueError, match="shape"):
        awq.quantize_clipped(w, awq.ClipRange(np.ones((32, 3), np.float32), np.zeros((32, 3), np.float32)),
                             group_size=64)
    with pytest.raises(ValueError, match="must not exceed"):
        awq.quantize_clipped(w, awq.ClipRange(np.zeros((32, 2), np.float32), np.ones((32, 2), np.float32)),
                             group_size=64)


def test_bad_fold_inputs_are_rejected():
    g = np.ones(8, np.float32)
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        awq.fold_scales_into_norm(g, None, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="finite and > 0"):
        awq.fold_scales_into_norm(g, None, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="norm_bias"):
        awq.fold_scales_into_norm(g, np.ones(4, np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        awq.fold_scales_into_linear(np.ones((8, 3), np.float32), None, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        awq.fold_scales_into_linear(g, None, g)


# ---------------------------------------------------------------------------------------------------------------
# CuPy

@pytest.mark.gpu
def test_cupy_matches_numpy(rng):
    import cupy as cp

    x, ws, _ = outlier_data(rng, 3000, 512, 128, n_layers=2)
    ref = awq.quantize_awq(ws, x, group_size=128, max_tokens=2000, seed=5)
    got = awq.quantize_awq([cp.asarray(w) for w in ws], cp.asarray(x), group_size=128, max_tokens=2000, seed=5)
    assert isinstance(got.scales, cp.ndarray) and isinstance(got.layers[0].Q, cp.ndarray)
    assert np.allclose(got.losses, ref.losses, rtol=1e-4), (got.losses, ref.losses)
    assert got.alpha == ref.alpha, (got.losses, ref.losses)
    assert np.allclose(cp.asnumpy(got.scales), ref.scales, rtol=1e-5)
    for g, r, w in zip(got.layers, ref.layers, ws):
        agree = float((cp.asnumpy(g.Q) == r.Q).mean())
        assert agree > 0.999, f"only {agree:.5f} of the codes agree"
        e_gpu = direct_mse(x, w, cp.asnumpy(g.fake_quant(np.float32) / got.scales))
        e_cpu = direct_mse(x, w, awq_weight(r, ref.scales))
        assert e_gpu == pytest.approx(e_cpu, rel=1e-2)
    with pytest.raises(TypeError, match="mix numpy and cupy"):
        awq.search_scales(ws[0], cp.asarray(x), group_size=128)
