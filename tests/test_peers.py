"""Peers as optional benchmark contenders: left out with a reason where they cannot run, and where they can (the
device, with humming-kernels installed), fed the same weights and checked against an independent numpy product."""
import sys
import types

import numpy as np
import pytest

from awq_cupy import bench, peers


def _fake_torch(cuda: bool):
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: cuda)
    return torch


def test_peer_without_torch_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch raises ImportError
    why = peers.PEERS["humming"].unavailable()
    assert why is not None and why.startswith("torch does not import")


def test_peer_without_cuda_in_torch_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda=False))
    assert peers.PEERS["humming"].unavailable() == "torch sees no CUDA device"


def test_peer_not_installed_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda=True))
    monkeypatch.setitem(sys.modules, "humming", None)
    why = peers.PEERS["humming"].unavailable()
    assert "humming does not import" in why and why.endswith("pip install humming-kernels")


def test_unavailable_peers_are_left_out_in_order(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    kept, skipped = bench.available_contenders(("awq_cupy", "humming", "cublas_fp16"))
    assert kept == ("awq_cupy", "cublas_fp16")
    assert list(skipped) == ["humming"] and "torch" in skipped["humming"]


def test_bench_layers_from_model_names_or_shapes():
    assert bench.layers(["mistral-7b"])[0] == ("mistral-7b", "qkv", 4096, 6144)
    assert len(bench.layers(["mistral-7b", "llama-2-70b"])) == 8
    rows = [("custom", "1024x768", 1024, 768), ("custom", "64x64", 64, 64)]   # what --shapes gives
    assert bench.layers(rows) == rows


def test_peer_without_a_builder_is_refused():
    with pytest.raises(TypeError, match="Peer 'nope': build must be callable, got NoneType"):
        peers.Peer("nope", "nope", "nope", None)


def test_prepare_hands_the_layer_to_the_peers_builder():
    seen = []
    p = peers.Peer("fake", "fake", "fake", lambda *a: seen.append(a) or "call")
    assert p.prepare([("w", "z", "s")], 64, 32, 64, "bfloat16") == "call"
    assert seen == [([("w", "z", "s")], 64, 32, 64, "bfloat16")]


def test_bench_takes_peers_as_contenders(monkeypatch):
    from awq_cupy import cli

    captured = {}
    monkeypatch.setattr(cli, "_cmd_bench", lambda args: captured.setdefault("args", args) and 0)
    cli.main(["bench", "--contenders", "awq_cupy", "humming"])
    assert captured["args"].contenders == ["awq_cupy", "humming"]


def _humming_or_skip():
    why = peers.PEERS["humming"].unavailable()
    if why is not None:
        pytest.skip(f"humming cannot run here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("K,N,M", [(512, 384, 1), (1024, 640, 37), (768, 256, 300)])
def test_humming_matches_numpy(rng, dtype, K, N, M):
    _humming_or_skip()
    import cupy

    from awq_cupy import formats
    from awq_cupy.dtypes import numpy_dtype

    G = 128
    Q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    Z = rng.integers(0, 16, (K // G, N), dtype=np.uint8)
    S = rng.uniform(0.001, 0.01, (K // G, N)).astype(np.float16)
    t = formats.pack(Q, Z, S, "gemm", G)
    call = peers.PEERS["humming"].prepare([(t["qweight"], t["qzeros"], t["scales"])] * 2, K, N, G, dtype)
    s = S.astype(np.float32)
    if dtype == "bfloat16":   # the peer takes bf16 scales for bf16 activations
        s = S.astype(numpy_dtype(dtype)).astype(np.float32)
    w = (Q.astype(np.float32) - np.repeat(Z, G, 0)) * np.repeat(s, G, 0)
    x = rng.standard_normal((M, K)).astype(np.float32).astype(numpy_dtype(dtype))
    ref = x.astype(np.float32) @ w
    y = cupy.full((M, N), np.nan, dtype=x.dtype)
    for i in range(2):      # both copies
        call(i, cupy.asarray(x), y)
        got = y.get().astype(np.float32)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-2, (i, err)


@pytest.mark.gpu
def test_bench_times_humming_beside_awq_cupy():
    _humming_or_skip()
    rows = bench.run([("custom", "1024x768", 1024, 768)], [3, 260], trials=1, rotate_mb=8,
                     contenders=("awq_cupy", "cublas_fp16", "humming"), progress=False)
    got = {(r.M, r.contender) for r in rows}
    assert got == {(M, c) for M in (3, 260) for c in ("awq_cupy", "cublas_fp16", "humming")}
    assert all(r.us > 0 and r.max_rel_err < 2e-2 for r in rows)
