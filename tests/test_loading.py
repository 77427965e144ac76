"""Checkpoint.to_gpu: which layers fuse (CPU), the fused gemm tensors (CPU), and on the GPU that a fused weight
gives the separate layers' results, biases, dtypes, names, validation and progress."""
import json

import numpy as np
import pytest

import awq_cupy
from awq_cupy import formats, loading
from awq_cupy.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from awq_cupy.loading import FuseRule, LoadGroup, plan_groups
from awq_cupy.quantize import quantize
from awq_cupy.safetensors_io import save_file

ATTN = "model.layers.{}.self_attn.{}"
MLP = "model.layers.{}.mlp.{}"


def _qt(rng, K, N, G):
    return quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float16), G)


def small_model(tmp_path, rng, *, K=128, G=64, kv=40, inter=136, biases=("q_proj", "v_proj"), fmt="gemm"):
    """Two decoder layers with GQA-sized k/v (awkward N), an MLP, q/v biases; gemm via save_checkpoint, other
    formats packed by hand. Returns (path, {name: QuantizedTensors}, {name: bias})."""
    layers, bias = {}, {}
    for i in range(2):
        for proj, N in (("q_proj", K), ("k_proj", kv), ("v_proj", kv), ("o_proj", K)):
            layers[ATTN.format(i, proj)] = _qt(rng, K, N, G)
            if proj in biases:
                bias[ATTN.format(i, proj)] = rng.standard_normal(N).astype(np.float16)
        for proj, N in (("gate_proj", inter), ("up_proj", inter)):
            layers[MLP.format(i, proj)] = _qt(rng, K, N, G)
        layers[MLP.format(i, "down_proj")] = _qt(rng, K, K, G)
    d = tmp_path / f"model_{fmt}"
    others = {f"{n}.bias": b for n, b in bias.items()}
    others["model.norm.weight"] = np.ones(K, np.float16)
    if fmt == "gemm":
        save_checkpoint(d, layers, others, group_size=G, config={"model_type": "llama"})
    else:
        d.mkdir()
        tensors = dict(others)
        for n, qt in layers.items():
            for k, v in formats.pack(qt.Q, qt.Z, qt.S, fmt, G).items():
                tensors[f"{n}.{k}"] = v
        save_file(d / "model.safetensors", tensors)
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
            "quant_method": "awq", "bits": 4, "group_size": G, "zero_point": fmt != "marlin", "version": fmt}}))
    return d, layers, bias


# -- CPU: the plan -------------------------------------------------------------------------------------------------

def test_plan_fuses_attention_and_mlp_in_place_of_the_first_part(tmp_path, rng):
    d, layers, _ = small_model(tmp_path, rng)
    with load_checkpoint(d) as ck:
        plan = plan_groups(ck.layers, True)
        assert plan_groups(ck.layers, False) == tuple(LoadGroup(n, (n,)) for n in ck.layers)
    want = []
    for i in range(2):
        qkv = tuple(ATTN.format(i, p) for p in ("q_proj", "k_proj", "v_proj"))
        want += [LoadGroup(ATTN.format(i, "qkv_proj"), qkv),
                 LoadGroup(ATTN.format(i, "o_proj"), (ATTN.format(i, "o_proj"),)),
                 LoadGroup(MLP.format(i, "gate_up_proj"), (MLP.format(i, "gate_proj"), MLP.format(i, "up_proj"))),
                 LoadGroup(MLP.format(i, "down_proj"), (MLP.format(i, "down_proj"),))]
    # the order of the checkpoint file (sorted names by save_checkpoint) decides where each group sits; compare sets
    # and that each fused group replaces its parts
    assert set(plan) == set(want) and len(plan) == len(want)
    assert all(g.fused == (len(g.members) > 1) for g in plan)


class _L:
    def __init__(self, K, G, N=8):
        self.in_features, self.group_size, self.out_features = K, G, N


def test_plan_keeps_incomplete_or_mismatched_groups_apart():
    layers = {"a.q_proj": _L(64, 64), "a.k_proj": _L(64, 64),                        # no v_proj
              "b.q_proj": _L(64, 64), "b.k_proj": _L(64, 32), "b.v_proj": _L(64, 64),  # different G
              "c.gate_proj": _L(64, 64), "c.up_proj": _L(128, 64),                   # different K
              "d.w1": _L(64, 64), "d.w3": _L(64, 64), "d.w2": _L(64, 64)}            # Mixtral expert
    plan = plan_groups(layers, True)
    fused = [g for g in plan if g.fused]
    assert fused == [LoadGroup("d.w13", ("d.w1", "d.w3"))]
    assert [m for g in plan for m in g.members] == list(layers)       # every layer exactly once, in order
    custom = plan_groups(layers, [FuseRule(("q_proj", "k_proj"), "qk")])
    assert [g for g in custom if g.fused] == [LoadGroup("a.qk", ("a.q_proj", "a.k_proj"))]


def test_plan_rejects_bad_rules_and_name_clashes():
    with pytest.raises(TypeError, match="fuse="):
        plan_groups({}, "qkv")
    with pytest.raises(ValueError, match="two or more distinct parts"):
        FuseRule(("q_proj",), "q")
    with pytest.raises(ValueError, match="already has a layer"):
        plan_groups({"x.gate_proj": _L(64, 64), "x.up_proj": _L(64, 64), "x.gate_up_proj": _L(64, 64)}, True)


def test_concatenated_gemm_tensors_unpack_to_the_parts_side_by_side(rng):
    """The fusion itself, on numpy: the joined qweight/qzeros/scales unpack to [Q1 Q2 Q3] etc., and the bias to
    the parts' biases with zeros for the part without one."""
    K, G, Ns = 256, 128, (64, 24, 40)
    qts = [_qt(rng, K, N, G) for N in Ns]
    parts = [formats.pack(q.Q, q.Z, q.S, "gemm", G) for q in qts]
    parts[0]["bias"] = rng.standard_normal(Ns[0]).astype(np.float16)
    parts[2]["bias"] = rng.standard_normal(Ns[2]).astype(np.float16)
    qweight, qzeros, scales, bias, spans = loading._concat(parts, [_L(K, G, N) for N in Ns])
    Q, Z, S = formats.unpack({"qweight": qweight, "qzeros": qzeros, "scales": scales}, "gemm", K, G)
    assert np.array_equal(Q, np.concatenate([q.Q for q in qts], axis=1))
    assert np.array_equal(Z, np.concatenate([q.Z for q in qts], axis=1))
    assert np.array_equal(S.view(np.uint16), np.concatenate([q.S for q in qts], axis=1).view(np.uint16))
    assert spans == ((0, 64), (64, 88), (88, 128))
    want_bias = np.concatenate([parts[0]["bias"].astype(np.float32), np.zeros(24, np.float32),
                                parts[2]["bias"].astype(np.float32)])
    assert bias.dtype == np.float32 and np.array_equal(bias, want_bias)


def test_to_gpu_without_a_gpu_says_so(tmp_path, rng, monkeypatch):
    from awq_cupy import _array

    d, _, _ = small_model(tmp_path, rng)
    monkeypatch.setattr(_array, "_GPU_AVAILABLE", False)
    monkeypatch.setattr(_array, "_NO_GPU_REASON", "cupy.cuda.is_available() is False: no NVIDIA driver here")
    with load_checkpoint(d) as ck:
        with pytest.raises(awq_cupy.GPUUnavailableError, match="Checkpoint.to_gpu needs a CUDA GPU"):
            ck.to_gpu()


# -- GPU -----------------------------------------------------------------------------------------------------------

def _matmul_host(x, w):
    import cupy

    return cupy.asnumpy(awq_cupy.matmul(x, w)).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gemm", "gemv", "gemv_fast"])
@pytest.mark.parametrize("M", [1, 7, 40, 300])
def test_fused_weight_matches_the_separate_layers(tmp_path, rng, fmt, M):
    import cupy

    d, layers, bias = small_model(tmp_path, rng, fmt=fmt, K=256, G=128)
    with load_checkpoint(d) as ck:
        sep = ck.to_gpu(fuse=False)
        fused = ck.to_gpu(fuse=True)
    assert set(sep) == set(layers)
    qkv = fused[ATTN.format(1, "qkv_proj")]
    names = [ATTN.format(1, p) for p in ("q_proj", "k_proj", "v_proj")]
    assert [p.name for p in qkv.parts] == names
    assert [(p.start, p.stop) for p in qkv.parts] == [(0, 256), (256, 296), (296, 336)]
    assert qkv.N == 336 and qkv.K == 256
    # the dense weight is bitwise the parts' weights side by side
    dense = cupy.asnumpy(awq_cupy.dequantize(qkv)).view(np.uint16)
    want = np.concatenate([cupy.asnumpy(awq_cupy.dequantize(sep[n])).view(np.uint16) for n in names], axis=1)
    assert np.array_equal(dense, want)
    # the fused bias is q's and v's with zeros for k
    want_bias = np.concatenate([bias[names[0]], np.zeros(40, np.float16), bias[names[2]]])
    assert np.array_equal(cupy.asnumpy(qkv.bias), want_bias)
    # and the matmul: the same columns within the tolerance of two kernel choices of one rounding each
    x = cupy.asarray(rng.standard_normal((M, 256)).astype(np.float16))
    y = awq_cupy.matmul(x, qkv)
    pieces = qkv.split(y)
    assert list(pieces) == names
    for n in names:
        ref = _matmul_host(x, sep[n])
        got = cupy.asnumpy(pieces[n]).astype(np.float32)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * float(np.abs(ref).max()))
    gu = fused[MLP.format(0, "gate_up_proj")]
    assert gu.bias is None and [p.width for p in gu.parts] == [136, 136]


@pytest.mark.gpu
def test_to_gpu_dtype_names_progress_and_bias(tmp_path, rng):
    import cupy

    d, layers, bias = small_model(tmp_path, rng)
    seen = []
    with load_checkpoint(d) as ck:
        ws = ck.to_gpu(dtype="bfloat16", names=[ATTN.format(0, "q_proj"), ATTN.format(0, "k_proj")],
                       progress=lambda *a: seen.append(a))
        assert set(ws) == {ATTN.format(0, "q_proj"), ATTN.format(0, "k_proj")}
        assert all(w.dtype == "bfloat16" and not w.parts for w in ws.values())
        assert [s[:2] for s in seen] == [(1, 2), (2, 2)]
        q = ws[ATTN.format(0, "q_proj")]
        b = cupy.asnumpy(q.bias.view(cupy.uint16)).astype(np.uint32) << 16
        np.testing.assert_allclose(b.view(np.float32), bias[ATTN.format(0, "q_proj")].astype(np.float32),
                                   rtol=1e-2)
        assert ws[ATTN.format(0, "k_proj")].bias is None
        with pytest.raises(ValueError, match="not quantized layers"):
            ck.to_gpu(names=["nope"])
        # split is only for fused weights
        with pytest.raises(ValueError, match="fused"):
            q.split(cupy.zeros((1, q.N), cupy.float16))


@pytest.mark.gpu
def test_to_gpu_rejects_nan_scales_naming_the_layer(tmp_path, rng):
    K, G = 128, 64
    good, bad = _qt(rng, K, 64, G), _qt(rng, K, 64, G)
    S = bad.S.copy()
    S[1, 63] = np.nan
    d = tmp_path / "nan"
    save_checkpoint(d, {"m.good": good, "m.bad": bad._replace(S=S)}, group_size=G)
    with load_checkpoint(d) as ck:
        with pytest.raises(CheckpointError, match=r"'m.bad'.*1 of its 128 scales are NaN or Inf.*\(1, 63\)"):
            ck.to_gpu()
        assert set(ck.to_gpu(validate=False)) == {"m.good", "m.bad"}
