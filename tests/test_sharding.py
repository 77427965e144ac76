"""Tensor-parallel shards of packed layers (awq_cupy/sharding.py), on the CPU: every format, both splits, fused
parts, the bias, and the errors. The reference is numpy: the full layer's logical codes dequantized in float32 and
sliced, against each shard unpacked on its own; and the ranks' partial products summed against the whole one."""
import numpy as np
import pytest

from awq_cupy import formats, load_checkpoint, save_checkpoint
from awq_cupy.checkpoint import QuantizedLayer
from awq_cupy.sharding import (DEFAULT_SHARD_RULES, ShardRule, Split, shard_layer, shard_layers, shard_range,
                               split_for)

FORMATS = ("gemm", "gemv", "gemv_fast", "marlin")


def make_layer(rng, fmt, K, N, G, *, name="model.layers.0.mlp.up_proj", bias=False):
    """A QuantizedLayer of ``fmt`` from random logical codes; returns it with the float32 dense W [K, N]."""
    Gr = formats.resolve_group_size(G, K)
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = (np.full((K // Gr, N), 8, np.uint8) if fmt == "marlin" else rng.integers(0, 16, (K // Gr, N), dtype=np.uint8))
    S = rng.uniform(0.001, 0.02, (K // Gr, N)).astype(np.float16)
    t = formats.pack(Q, Z, S, fmt, G)
    b = (rng.standard_normal(N) * 0.1).astype(np.float16) if bias else None
    layer = QuantizedLayer(name=name, format=fmt, in_features=K, out_features=N, group_size=Gr, config_group_size=G,
                           tensors=t, bias=b)
    W = (Q.astype(np.float32) - np.repeat(Z, Gr, 0)) * np.repeat(S.astype(np.float32), Gr, 0)
    return layer, W


def dense(shard_layer_):
    """float32 W of a shard, from its own packed tensors."""
    q = shard_layer_.unpack()
    G = q.group_size
    return (q.Q.astype(np.float32) - np.repeat(q.Z, G, 0)) * np.repeat(q.S.astype(np.float32), G, 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_hold_exactly_their_slice(rng, fmt, tp):
    K, N, G = 1024, 512, 128
    layer, W = make_layer(rng, fmt, K, N, G, bias=fmt != "marlin")
    x = rng.standard_normal((3, K)).astype(np.float32)
    cols, partial = [], np.zeros((3, N), np.float32)
    for rank in range(tp):
        c = shard_layer(layer, Split.COLUMN, tp, rank)
        (a, b), = c.ranges
        assert (c.layer.in_features, c.layer.out_features, c.layer.format) == (K, N // tp, fmt)
        assert (a, b) == (rank * N // tp, (rank + 1) * N // tp)
        np.testing.assert_array_equal(dense(c.layer), W[:, a:b])
        if layer.bias is not None:
            np.testing.assert_array_equal(c.layer.bias, layer.bias[a:b])
        cols.append(dense(c.layer))

        r = shard_layer(layer, Split.ROW, tp, rank)
        (k0, k1), = r.ranges
        assert (r.layer.in_features, r.layer.out_features) == (K // tp, N) and (k0, k1) == (rank * K // tp,
                                                                                             (rank + 1) * K // tp)
        np.testing.assert_array_equal(dense(r.layer), W[k0:k1])
        assert (r.layer.bias is not None) == (layer.bias is not None and rank == 0)   # added once, to the sum
        partial += x[:, k0:k1] @ dense(r.layer)
    np.testing.assert_array_equal(np.concatenate(cols, axis=1), W)
    np.testing.assert_allclose(partial, x @ W, rtol=1e-5, atol=1e-4)


def test_llm_awq_scaled_zeros_keep_their_name(rng):
    layer, W = make_layer(rng, "gemv_fast", 512, 128, 128)
    t = dict(layer.tensors)
    t["scaled_zeros"] = t.pop("qzeros")
    import dataclasses

    s = shard_layer(dataclasses.replace(layer, tensors=t), Split.ROW, 2, 1)
    assert set(s.layer.tensors) == {"qweight", "scaled_zeros", "scales"}
    assert s.layer.dtype_codes == {"qweight": "I16", "scaled_zeros": "F16", "scales": "F16"}
    np.testing.assert_array_equal(dense(s.layer), W[256:])


@pytest.mark.parametrize("fmt", ["gemm", "gemv", "gemv_fast"])
def test_one_group_layer_splits_by_columns_only(rng, fmt):
    K, N = 512, 128
    layer, W = make_layer(rng, fmt, K, N, -1)
    s = shard_layer(layer, Split.COLUMN, 2, 1)
    assert s.layer.config_group_size == -1 and s.layer.group_size == K
    np.testing.assert_array_equal(dense(s.layer), W[:, 64:])
    with pytest.raises(ValueError, match=r"one group spans all of K=512.*row split needs G < K"):
        shard_layer(layer, Split.ROW, 2, 0)
    assert shard_layer(layer, Split.ROW, 1, 0).layer.in_features == K      # tp = 1: the layer itself


def test_fused_parts_are_split_each_on_their_own(rng):
    q, k, v = 512, 128, 128                   # a GQA qkv_proj: four query heads per key/value head of 128
    layer, W = make_layer(rng, "gemm", 256, q + k + v, 128, name="model.layers.3.self_attn.qkv_proj", bias=True)
    for rank in range(2):
        s = shard_layer(layer, Split.COLUMN, 2, rank, parts=(q, k, v), align=64)
        want = [(rank * 256, rank * 256 + 256), (q + rank * 64, q + rank * 64 + 64),
                (q + k + rank * 64, q + k + rank * 64 + 64)]
        assert list(s.ranges) == want
        idx = np.concatenate([np.arange(a, b) for a, b in want])
        np.testing.assert_array_equal(dense(s.layer), W[:, idx])
        np.testing.assert_array_equal(s.layer.bias, layer.bias[idx])
    with pytest.raises(ValueError, match=r"part 1 of the output \(128 of N=768\).*multiple of 128.*align=128"):
        shard_layer(layer, Split.COLUMN, 2, 0, parts=(q, k, v), align=128)
    with pytest.raises(ValueError, match=r"parts=\[512, 128\] must be positive and sum to N=768"):
        shard_layer(layer, Split.COLUMN, 2, 0, parts=(q, k))
    with pytest.raises(ValueError, match="parts split the output features"):
        shard_layer(layer, Split.ROW, 2, 0, parts=(q, k, v))


@pytest.mark.parametrize("fmt,K,N,G,split,tp,message", [
    ("gemm", 512, 256, 128, Split.COLUMN, 3, r"N \(out_features\)=256 does not split 3 ways"),
    ("gemm", 512, 200, 128, Split.COLUMN, 2, r"N \(out_features\)=200 does not split 2 ways: each share must be a "
                                             r"multiple of 8 \(eight channels per packed word\)"),
    ("gemm", 512, 256, 128, Split.ROW, 8, r"K \(in_features\)=512 does not split 8 ways: each share must be a "
                                          r"multiple of 128 \(whole groups of G=128\)"),
    ("marlin", 512, 256, 128, Split.COLUMN, 8, r"shard 0 of 8 \(column split\) is not a valid marlin layer: "
                                               r"N=32 is not a multiple of 64"),
    ("gemv_fast", 256, 64, 32, Split.ROW, 8, r"shard 0 of 8 \(row split\) is not a valid gemv_fast layer: "
                                             r"K=32 is not a multiple of 64"),
])
def test_impossible_splits_name_the_layer_size_and_rule(rng, fmt, K, N, G, split, tp, message):
    layer, _ = make_layer(rng, fmt, K, N, G, name="model.layers.7.mlp.down_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.down_proj: .*" + message):
        shard_layer(layer, split, tp, 0)


def test_bad_arguments(rng):
    layer, _ = make_layer(rng, "gemm", 256, 64, 128)
    with pytest.raises(ValueError, match=r"rank=2 must be in 0\.\.1 for tp_size=2"):
        shard_layer(layer, Split.COLUMN, 2, 2)
    with pytest.raises(ValueError, match="tp_size=0 must be at least 1"):
        shard_layer(layer, Split.COLUMN, 0, 0)
    with pytest.raises(TypeError, match="tp_size must be an int"):
        shard_layer(layer, Split.COLUMN, 2.0, 0)
    with pytest.raises(TypeError, match="split must be a Split"):
        shard_layer(layer, "column", 2, 0)
    with pytest.raises(TypeError, match="takes a QuantizedLayer"):
        shard_layer(layer.tensors, Split.COLUMN, 2, 0)
    with pytest.raises(ValueError, match="align=0 must be a positive int"):
        shard_layer(layer, Split.COLUMN, 2, 0, align=0)


def test_llama70b_down_splits_eight_ways_into_28_groups():
    assert [shard_range(28672, 8, r, unit=128, what="K", rule="groups") for r in (0, 7)] == [(0, 3584),
                                                                                            (25088, 28672)]
    assert 3584 // 128 == 28
    assert shard_range(28672, 32, 31, unit=128, what="K", rule="groups") == (27776, 28672)   # 7 groups each
    with pytest.raises(ValueError, match="K=28672 does not split 64 ways"):   # 448 rows: three and a half groups
        shard_range(28672, 64, 0, unit=128, what="K", rule="groups")


def test_rules_pick_the_split_by_module_name():
    assert split_for("model.layers.0.self_attn.q_proj") is Split.COLUMN
    assert split_for("model.layers.0.mlp.gate_up_proj") is Split.COLUMN
    assert split_for("model.layers.0.self_attn.o_proj") is Split.ROW
    assert split_for("model.layers.0.block_sparse_moe.experts.3.w2") is Split.ROW
    assert split_for("lm_head") is None
    both = (ShardRule(("o_proj",), Split.ROW), ShardRule(("o_proj",), Split.COLUMN))
    with pytest.raises(ValueError, match="give it both splits"):
        split_for("x.o_proj", both)
    with pytest.raises(ValueError, match="needs one or more module names"):
        ShardRule((), Split.ROW)
    assert DEFAULT_SHARD_RULES[0].split is Split.COLUMN


def test_checkpoint_layers_shard_from_disk(tmp_path, rng):
    """From a saved checkpoint (read-only memmapped tensors): every layer split by its rule or replicated, and the
    two ranks together give the whole layers back."""
    from awq_cupy.quantize import quantize

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
             "lm_head"]
    layers = {n: quantize((rng.standard_normal((256, 512)) * 0.05).astype(np.float16), 128) for n in names}
    d = save_checkpoint(tmp_path / "ckpt", layers, group_size=128)
    with load_checkpoint(d) as ckpt:
        full = {n: ckpt.layers[n].dequantize(np.float32) for n in names}
        shards = [shard_layers(ckpt.layers, 2, r) for r in range(2)]
        for n in names:
            s0, s1 = shards[0][n], shards[1][n]
            if n == "lm_head":
                assert s0.split is None and s0.layer is ckpt.layers[n]
                continue
            axis = 1 if s0.split is Split.COLUMN else 0
            assert s0.split is (Split.COLUMN if n.endswith("q_proj") else Split.ROW)
            got = np.concatenate([s0.layer.dequantize(np.float32), s1.layer.dequantize(np.float32)], axis=axis)
            np.testing.assert_array_equal(got, full[n])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gemm", "gemv_fast"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_shards_on_the_gpu_sum_to_the_whole_layer(rng, fmt, dtype):
    """One GPU, every rank in turn: the column shards' outputs side by side and the row shards' partial outputs
    summed (what the all-reduce will do) equal the unsharded matmul within fp16/bf16 reduction-order noise."""
    import cupy as cp

    import awq_cupy
    from awq_cupy.dtypes import numpy_dtype

    K, N, M, tp = 1024, 768, 5, 4
    layer, W = make_layer(rng, fmt, K, N, 128, bias=True)
    x = rng.standard_normal((M, K)).astype(np.float32).astype(numpy_dtype(dtype))
    xg = cp.asarray(x)

    def matmul(x, lay):   # the layer's own bias, where it has one (a row shard's only on rank 0)
        t = lay.to_gemm()
        w = awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], lay.config_group_size,
                                               dtype=dtype, bias=lay.bias)
        return awq_cupy.matmul(x, w, bias=w.bias).get().astype(np.float32)

    whole = matmul(xg, layer)
    ref = x.astype(np.float32) @ W + layer.bias.astype(np.float32)
    scale = np.abs(ref).max()
    # a shard's launch plan can differ from the whole layer's (narrower N), and with it the sum order: no bitwise check
    cols = np.concatenate([matmul(xg, shard_layer(layer, Split.COLUMN, tp, r).layer) for r in range(tp)], axis=1)
    assert np.abs(cols - ref).max() / scale < 2e-2
    rows = np.zeros((M, N), np.float32)
    for r in range(tp):
        s = shard_layer(layer, Split.ROW, tp, r)
        (a, b), = s.ranges
        rows += matmul(cp.ascontiguousarray(xg[:, a:b]), s.layer)
    assert np.abs(rows - ref).max() / scale < 2e-2 and np.abs(whole - ref).max() / scale < 2e-2
