"""awq_cupy.convert: AWQ checkpoints of every layout rewritten as gemm (lossless), dense models quantized by
round-to-nearest, side files, destination rules, errors and the CLI backend ``main``; CPU only.

Source checkpoints are written with the reference writer (``safetensors.numpy.save_file``) where they stand in for
files AutoAWQ or transformers wrote; dense bf16 weights are uint16 bit patterns declared BF16 by our writer, the
way a model without ml_dtypes reaches us.
"""
import io
import json
import warnings
import weakref

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file as st_save_file

from awq_cupy import checkpoint, convert, formats, safetensors_io
from awq_cupy.checkpoint import CheckpointError, load_checkpoint
from awq_cupy.convert import ConvertResult, SourceKind, UnquantizedWeight, convert_checkpoint, main
from awq_cupy.quantize import quantize
from awq_cupy.safetensors_io import SafetensorsFile

from conftest import FIXTURES

BF16 = np.dtype(ml_dtypes.bfloat16)
BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "torch_dtype": "float16"}
SIDE = {"tokenizer.json": '{"model": "bpe"}', "tokenizer_config.json": '{"a": 1}', "tokenizer.model": "\x00spm",
        "special_tokens_map.json": "{}", "generation_config.json": '{"do_sample": false}', "merges.txt": "a b\n"}
NOT_SIDE = {"pytorch_model.bin": "old weights", "pytorch_model.bin.index.json": "{}", ".gitattributes": "*"}


# -- helpers ------------------------------------------------------------------------------------------------------

def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes()


def assert_same_logical(layer, qt):
    Q, Z, S = layer.unpack()[:3]
    assert np.array_equal(Q, qt.Q), f"{layer.name}: Q differs"
    assert np.array_equal(Z, qt.Z), f"{layer.name}: Z differs"
    assert bits_equal(S, qt.S), f"{layer.name}: S differs"


def write_side_files(d, files=SIDE):
    for name, text in files.items():
        (d / name).write_text(text)


def write_tensors(d, tensors, shards=None, writer=st_save_file, **kw):
    """model.safetensors, or ``shards`` (lists of names) with model.safetensors.index.json."""
    if shards is None:
        writer(tensors, d / "model.safetensors", **kw)
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n] for n in names}
        if writer is st_save_file:
            writer(part, d / fname)
        else:
            writer(part, d / fname, dtypes={n: c for n, c in kw.get("dtypes", {}).items() if n in part})
        weight_map.update({n: fname for n in names})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def st_write(tensors, path, dtypes=None):
    """Our writer with declared dtypes (BF16 for uint16 bit patterns), in save_file's argument order."""
    safetensors_io.save_file(path, tensors, {"format": "pt"}, dtypes=dtypes)


def read_back(d):
    """Every tensor of a written checkpoint as (declared dtype, array), bf16 as bit patterns."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        sf = SafetensorsFile(f, bf16="uint16")
        out.update({n: (sf.dtype_code(n), np.array(sf.get(n))) for n in sf.keys()})
    return out


def load_quietly(d):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a written checkpoint must load without any warning
        return load_checkpoint(d, bf16="uint16")


# -- AWQ input ----------------------------------------------------------------------------------------------------

UP, DOWN = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
# (K, N, G): awkward widths; marlin needs N % 64 == 0, gemv_fast K % 64 == 0
AWQ_SHAPES = {"a": (384, 136, 128), "b": (256, 136, -1), "c": (512, 72, 64)}
MARLIN_SHAPES = {"a": (384, 192, 128), "b": (256, 128, -1), "c": (512, 64, 64)}


def make_awq(d, rng, fmt, K, N, G, *, shards=False, extra_quant=None):
    """An AWQ checkpoint of two layers (one with a bias) plus embedding, BF16 norm, float32 and int64 tensors.
    Returns ({module: (QuantizedTensors, packed)}, other tensors)."""
    d.mkdir(parents=True, exist_ok=True)
    layers, tensors = {}, {}
    for module, bias in ((UP, True), (DOWN, False)):
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float16)
        qt = quantize(w, G, zero_point=fmt != "marlin")
        packed = formats.pack(qt.Q, qt.Z, qt.S, fmt, G)
        if bias:
            packed["bias"] = rng.standard_normal(N).astype(np.float16)
        layers[module] = (qt, packed)
        tensors.update({f"{module}.{k}": v for k, v in packed.items()})
    others = {"model.embed_tokens.weight": rng.standard_normal((32, K)).astype(np.float16),
              "model.norm.weight": rng.standard_normal(K).astype(np.float32).astype(BF16),
              "model.rotary.inv_freq": rng.standard_normal(8).astype(np.float32),
              "model.position_ids": np.arange(16, dtype=np.int64)}
    tensors.update(others)
    quant = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": fmt != "marlin", "version": fmt,
             "modules_to_not_convert": ["vision_tower"], **(extra_quant or {})}
    (d / "config.json").write_text(json.dumps({**BASE_CONFIG, "quantization_config": quant}))
    names = sorted(tensors)
    write_tensors(d, tensors, shards=[names[:5], names[5:]] if shards else None)
    write_side_files(d)
    write_side_files(d, NOT_SIDE)
    return layers, others


@pytest.mark.parametrize("case", sorted(AWQ_SHAPES))
@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_awq_round_trip_every_format(tmp_path, rng, fmt, case):
    K, N, G = (MARLIN_SHAPES if fmt == "marlin" else AWQ_SHAPES)[case]
    layers, others = make_awq(tmp_path / "src", rng, fmt, K, N, G, shards=case == "b")
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out")

    assert isinstance(result, ConvertResult) and result.kind is SourceKind.AWQ
    assert result.destination == tmp_path / "out" and result.source_formats == (fmt,)
    assert set(result.quantized) == {UP, DOWN} and set(result.passed_through) == set(others)
    assert (result.group_size, result.zero_point, result.unquantized) == (G, fmt != "marlin", ())
    out = load_quietly(tmp_path / "out")
    assert set(out.layers) == {UP, DOWN}
    for module, (qt, packed) in layers.items():
        layer = out.layers[module]
        assert (layer.format, layer.in_features, layer.out_features, layer.config_group_size) == ("gemm", K, N, G)
        assert_same_logical(layer, qt)
        if "bias" in packed:
            assert bits_equal(layer.bias, packed["bias"])
        else:
            assert layer.bias is None
    written = read_back(tmp_path / "out")
    for name, want in others.items():
        code, got = written[name]
        assert code == safetensors_io.dtype_code_of(want.dtype) and bits_equal(got, want), name
    assert written["model.norm.weight"][0] == "BF16"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: cfg[k] for k in BASE_CONFIG} == BASE_CONFIG
    assert cfg["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G,
                                          "zero_point": fmt != "marlin", "modules_to_not_convert": ["vision_tower"]}
    assert result.side_files == tuple(sorted(SIDE))
    for name, text in SIDE.items():
        assert (tmp_path / "out" / name).read_text() == text, name
    for name in NOT_SIDE:
        assert not (tmp_path / "out" / name).exists(), name
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("e", json.loads((FIXTURES / "index.json").read_text()),
                         ids=lambda e: e["file"].removesuffix(".safetensors"))
def test_autoawq_golden_layers_convert_losslessly(tmp_path, e):
    """AutoAWQ's own packed layers (bare tensor names: module ''): the gemm output means the same weight."""
    fmt, G = e["format"], e["group_size"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes((FIXTURES / e["file"]).read_bytes())
    (src / "config.json").write_text(json.dumps({**BASE_CONFIG, "quantization_config": {
        "quant_method": "awq", "bits": 4, "version": fmt.upper(), "group_size": G, "zero_point": fmt != "marlin"}}))
    result = convert_checkpoint(src, tmp_path / "out", group_size=G)
    source = load_checkpoint(src).layers[""]
    layer = load_quietly(tmp_path / "out").layers[""]
    assert result.quantized == ("",) and layer.format == "gemm"
    assert_same_logical(layer, source.unpack())
    want = np.asarray(load_checkpoint(src).tensors["weight_fake_quant"]) + np.float16(0)   # marlin's -0.0
    assert bits_equal(layer.unpack().fake_quant(), want)
    assert bits_equal(layer.bias, load_checkpoint(src).tensors["bias_in"])


def test_awq_old_config_file_and_extra_skip_patterns(tmp_path, rng):
    """An old quant_config.json becomes config.json's quantization_config (and is not copied); skip patterns that
    match no quantized layer join modules_to_not_convert."""
    layers, _ = make_awq(tmp_path / "src", rng, "gemv", 256, 64, 128)
    (tmp_path / "src" / "config.json").write_text(json.dumps(BASE_CONFIG))
    (tmp_path / "src" / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMV"}))
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", skip=["lm_head", "vision"])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["quantization_config"]["modules_to_not_convert"] == ["lm_head", "vision"]
    assert result.modules_to_not_convert == ("lm_head", "vision")
    assert not (tmp_path / "out" / "quant_config.json").exists()
    assert_same_logical(load_quietly(tmp_path / "out").layers[UP], layers[UP][0])


# -- dense input --------------------------------------------------------------------------------------------------

P = "model.layers.0"
# name -> shape of a small dense model; which of them are quantized and why the others are not is asserted below
DENSE_SHAPES = {
    "model.embed_tokens.weight": (64, 256),
    f"{P}.self_attn.q_proj.weight": (128, 256), f"{P}.self_attn.q_proj.bias": (128,),
    f"{P}.mlp.up_proj.weight": (136, 384),
    f"{P}.mlp.down_proj.weight": (256, 384),                 # skipped by pattern
    f"{P}.mlp.odd_n.weight": (100, 256), f"{P}.mlp.odd_n.bias": (100,),    # N % 8 != 0
    f"{P}.mlp.odd_k.weight": (64, 200),                      # K % 128 != 0
    f"{P}.block_sparse_moe.gate.weight": (8, 256),           # MoE router
    f"{P}.input_layernorm.weight": (256,),
    "model.norm.weight": (256,),
    "lm_head.weight": (64, 256),
}
QUANTIZED = {f"{P}.self_attn.q_proj", f"{P}.mlp.up_proj"}
REASONS = {
    "model.embed_tokens.weight": "embedding (name matches 'embed')",
    f"{P}.mlp.down_proj.weight": "matches skip pattern 'mlp.down_proj'",
    f"{P}.mlp.odd_n.weight": "N=100 is not a multiple of 8",
    f"{P}.mlp.odd_k.weight": "K=200 is not a multiple of group_size 128",
    f"{P}.block_sparse_moe.gate.weight": "router",
    "lm_head.weight": "output head (name matches 'lm_head')",
}


def make_dense(d, rng, code, *, shards=False, shapes=DENSE_SHAPES, side=True):
    """A dense model whose floats are ``code`` (F16, BF16 as uint16 bit patterns, F32) plus an int64 buffer.
    Returns {name: array as written} (bf16 as bit patterns)."""
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        tensors[name] = {"F16": w.astype(np.float16), "F32": w,
                         "BF16": formats.float32_to_bf16_bits(w)}[code]
    tensors["model.position_ids"] = np.arange(16, dtype=np.int64)
    dtypes = {n: "BF16" for n, a in tensors.items() if a.dtype == np.uint16}
    (d / "config.json").write_text(json.dumps({**BASE_CONFIG, "torch_dtype": "bfloat16"}))
    names = sorted(tensors)
    write_tensors(d, tensors, shards=[names[:6], names[6:]] if shards else None, writer=st_write, dtypes=dtypes)
    if side:
        write_side_files(d)
        write_side_files(d, NOT_SIDE)
    return tensors


def source_weight(arr, code):
    """The source weight as quantize() takes it, computed independently of convert: bf16 bits -> ml_dtypes."""
    return arr.view(BF16) if code == "BF16" else arr


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("code", ["F16", "BF16", "F32"])
def test_dense_round_trip(tmp_path, rng, code, sharded):
    src = make_dense(tmp_path / "src", rng, code, shards=sharded)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", skip=["mlp.down_proj"])

    assert result.kind is SourceKind.DENSE and result.source_formats == ()
    assert set(result.quantized) == QUANTIZED and (result.group_size, result.zero_point) == (128, True)
    reasons = {u.name: u.reason for u in result.unquantized}
    assert set(reasons) == set(REASONS)
    for name, part in REASONS.items():
        assert part in reasons[name], (name, reasons[name])
    passed = set(src) - {f"{m}.weight" for m in QUANTIZED} - {f"{P}.self_attn.q_proj.bias"}
    assert set(result.passed_through) == passed
    not_convert = ["mlp.down_proj", f"{P}.mlp.odd_n", f"{P}.mlp.odd_k", f"{P}.block_sparse_moe.gate"]
    assert result.modules_to_not_convert[0] == "mlp.down_proj"
    assert sorted(result.modules_to_not_convert) == sorted(not_convert)

    out = load_quietly(tmp_path / "out")
    assert set(out.layers) == QUANTIZED and set(out.tensors) == passed
    for module in QUANTIZED:
        want = quantize(source_weight(src[f"{module}.weight"], code), 128)
        layer = out.layers[module]
        assert layer.format == "gemm" and layer.group_size == 128
        assert_same_logical(layer, want)
    bias = src[f"{P}.self_attn.q_proj.bias"]
    bias32 = formats.bf16_bits_to_float32(bias) if code == "BF16" else bias.astype(np.float32)
    assert bits_equal(out.layers[f"{P}.self_attn.q_proj"].bias, bias32.astype(np.float16))
    written = read_back(tmp_path / "out")
    for name in passed:
        got_code, got = written[name]
        assert got_code == ("I64" if name == "model.position_ids" else code), name
        assert bits_equal(got, src[name]), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: cfg[k] for k in BASE_CONFIG if k != "torch_dtype"} == {k: v for k, v in BASE_CONFIG.items()
                                                                      if k != "torch_dtype"}
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
                                          "zero_point": True,
                                          "modules_to_not_convert": list(result.modules_to_not_convert)}
    assert result.side_files == tuple(sorted(SIDE))
    assert all((tmp_path / "out" / n).read_text() == t for n, t in SIDE.items())
    assert not any((tmp_path / "out" / n).exists() for n in NOT_SIDE)


@pytest.mark.parametrize("code", ["F16", "BF16"])
def test_dense_one_group_symmetric_sharded_output(tmp_path, rng, code):
    shapes = {f"{P}.mlp.up_proj.weight": (64, 264), f"{P}.mlp.gate_proj.weight": (128, 96)}
    src = make_dense(tmp_path / "src", rng, code, shapes=shapes, side=False)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", group_size=-1, zero_point=False,
                                max_shard_size=10_000)
    assert set(result.quantized) == {f"{P}.mlp.up_proj", f"{P}.mlp.gate_proj"} and result.unquantized == ()
    assert result.modules_to_not_convert == () and result.side_files == ()
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    out = load_quietly(tmp_path / "out")
    for module in result.quantized:
        want = quantize(source_weight(src[f"{module}.weight"], code), -1, zero_point=False)
        assert (out.layers[module].config_group_size, out.layers[module].group_size) == (-1, want.Q.shape[0])
        assert_same_logical(out.layers[module], want)
        assert (want.Z == 8).all()
    qc = out.quant_config
    assert (qc.group_size, qc.zero_point, qc.modules_to_not_convert) == (-1, False, ())


def test_dense_group_size_64_reasons(tmp_path, rng):
    """K % G is judged against the group size asked for: K=200 is still refused at G=64, K=320 is not."""
    shapes = {f"{P}.mlp.a.weight": (64, 320), f"{P}.mlp.b.weight": (64, 200)}
    make_dense(tmp_path / "src", rng, "F16", shapes=shapes, side=False)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", group_size=64)
    assert result.quantized == (f"{P}.mlp.a",)
    assert result.unquantized == (UnquantizedWeight(f"{P}.mlp.b.weight",
                                                    "in_features K=200 is not a multiple of group_size 64"),)
    assert load_quietly(tmp_path / "out").layers[f"{P}.mlp.a"].group_size == 64


# -- destination rules and errors ---------------------------------------------------------------------------------

def test_same_folder_is_refused(tmp_path, rng):
    make_dense(tmp_path / "src", rng, "F16", side=False)
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    (tmp_path / "link").symlink_to(tmp_path / "src")
    for dst in (tmp_path / "src", tmp_path / "src" / ".", tmp_path / "link"):
        with pytest.raises(ValueError, match="same folder"):
            convert_checkpoint(tmp_path / "src", dst)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == before


def test_existing_destination_needs_overwrite(tmp_path, rng):
    make_dense(tmp_path / "src", rng, "F16")
    dst = tmp_path / "out"
    dst.mkdir()
    old = {"model.safetensors": b"old weights", "config.json": b"{}", "tokenizer.json": b"old tokenizer"}
    for name, data in old.items():
        (dst / name).write_bytes(data)
    with pytest.raises(FileExistsError, match="overwrite") as e:
        convert_checkpoint(tmp_path / "src", dst)
    assert "model.safetensors" in str(e.value) and "tokenizer.json" in str(e.value)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == old            # nothing clobbered, nothing added

    # a folder without a checkpoint but with a different side file: still refused, still untouched
    (dst / "model.safetensors").unlink()
    (dst / "config.json").unlink()
    with pytest.raises(FileExistsError, match="tokenizer.json"):
        convert_checkpoint(tmp_path / "src", dst)
    assert [p.name for p in dst.iterdir()] == ["tokenizer.json"]
    # an identical side file is no conflict
    (dst / "tokenizer.json").write_text(SIDE["tokenizer.json"])
    convert_checkpoint(tmp_path / "src", dst)
    with pytest.raises(FileExistsError, match="model.safetensors"):
        convert_checkpoint(tmp_path / "src", dst)
    (dst / "tokenizer.json").write_text("changed")
    result = convert_checkpoint(tmp_path / "src", dst, overwrite=True)
    assert (dst / "tokenizer.json").read_text() == SIDE["tokenizer.json"]
    assert set(load_quietly(dst).layers) == set(result.quantized) == QUANTIZED | {f"{P}.mlp.down_proj"}


def test_awq_option_conflicts(tmp_path, rng):
    make_awq(tmp_path / "src", rng, "gemm", 256, 64, 128)
    with pytest.raises(ValueError, match=r"group_size=64 differs from the checkpoint's group_size=128"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", group_size=64)
    with pytest.raises(ValueError, match="zero_point=False"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", zero_point=False)
    with pytest.raises(ValueError, match=f"skip pattern 'up_proj' matches the quantized layer '{UP}'"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", skip=["up_proj"])
    assert not (tmp_path / "out").exists()
    assert convert_checkpoint(tmp_path / "src", tmp_path / "out", group_size=128).group_size == 128


def _folder(tmp_path, rng, case):
    d = tmp_path / case
    d.mkdir()
    if case == "empty":
        pass
    elif case == "weights only":
        st_save_file({"w": np.zeros((8, 8), np.float16)}, d / "model.safetensors")
    elif case == "gptq":
        make_dense(d, rng, "F16", side=False)
        (d / "config.json").write_text(json.dumps({**BASE_CONFIG, "quantization_config": {
            "quant_method": "gptq", "bits": 4}}))
    elif case == "8-bit awq":
        make_awq(d, rng, "gemm", 256, 64, 128, extra_quant={"bits": 8})
    elif case == "no weights":
        (d / "config.json").write_text(json.dumps(BASE_CONFIG))
    elif case == "bin only":
        (d / "config.json").write_text(json.dumps(BASE_CONFIG))
        (d / "pytorch_model.bin").write_bytes(b"\x80\x02")
    elif case == "awq without config":
        make_awq(d, rng, "gemm", 256, 64, 128)
        (d / "config.json").write_text(json.dumps(BASE_CONFIG))
    elif case == "a file":
        d.rmdir()
        d.write_text("x")
    elif case == "missing":
        d.rmdir()
    elif case == "nothing quantizable":
        make_dense(d, rng, "F16", shapes={"model.embed_tokens.weight": (64, 256), "model.norm.weight": (256,)})
    return d


FOLDER_ERRORS = {
    "empty": (CheckpointError, r"not a model folder.*it has no config\.json.*dense model needs config\.json"),
    "weights only": (CheckpointError, r"holds safetensors weights but no config\.json"),
    "gptq": (CheckpointError, r"quant_method 'gptq' is not supported.*convert takes AWQ 4-bit checkpoints and dense"),
    "8-bit awq": (CheckpointError, r"bits=8 is not supported"),
    "no weights": (CheckpointError, r"no weights found"),
    "bin only": (CheckpointError, r"\.bin weights only; convert reads safetensors"),
    "awq without config": (CheckpointError, r"holds AWQ tensors .* has no quantization_config"),
    "a file": (CheckpointError, r"is not a directory"),
    "missing": (CheckpointError, r"does not exist"),
    "nothing quantizable": (ValueError, r"no weight can be quantized \(model\.embed_tokens\.weight: embedding"),
}


@pytest.mark.parametrize("case", sorted(FOLDER_ERRORS))
def test_folders_that_cannot_be_converted(tmp_path, rng, case, capsys):
    d = _folder(tmp_path, rng, case)
    exc, match = FOLDER_ERRORS[case]
    with pytest.raises(exc, match=match) as e:
        convert_checkpoint(d, tmp_path / "out")
    assert str(d) in str(e.value)                                   # the message names the folder
    assert not (tmp_path / "out").exists()
    assert main(d, tmp_path / "out") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and str(d) in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(group_size=48), ValueError, "group_size=48 is not supported by the awq_cupy kernels"),
    (dict(group_size=0), ValueError, "must be -1"),
    (dict(skip="mlp"), TypeError, "list of patterns"),
    (dict(skip=[""]), ValueError, "empty skip pattern"),
    (dict(max_shard_size="lots"), ValueError, "max_shard_size"),
])
def test_dense_option_errors(tmp_path, rng, kwargs, exc, match):
    make_dense(tmp_path / "src", rng, "F16", side=False)
    with pytest.raises(exc, match=match):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_main_reports_and_returns(tmp_path, rng, capsys):
    make_dense(tmp_path / "src", rng, "BF16")
    stream = io.StringIO()
    assert main(tmp_path / "src", tmp_path / "out", skip=["mlp.down_proj"], stream=stream) == 0
    text = stream.getvalue()
    assert "converted dense checkpoint" in text and "quantized layers: 2 (quantized by round-to-nearest" in text
    assert f"passed through: {len(DENSE_SHAPES) + 1 - 3} tensor(s)" in text
    assert f"left unquantized: {len(REASONS)} linear-looking weight(s)" in text
    assert f"    {P}.mlp.odd_n.weight: out_features N=100 is not a multiple of 8" in text
    assert "modules_to_not_convert: mlp.down_proj, " in text and "side files copied: generation_config.json" in text
    assert text.rstrip().endswith(f"wrote {tmp_path / 'out'}")
    assert capsys.readouterr().err == ""
    # the same destination again: refused, exit status 2, one error line
    assert main(tmp_path / "src", tmp_path / "out", stream=stream) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "overwrite" in err and "Traceback" not in err and err.count("\n") == 1
    # an AWQ conflict through main
    make_awq(tmp_path / "awq", rng, "gemv", 256, 64, 128)
    assert main(tmp_path / "awq", tmp_path / "awq_out", group_size=-1, stream=stream) == 2
    assert "differs from the checkpoint's group_size=128" in capsys.readouterr().err
    stream = io.StringIO()
    assert main(tmp_path / "awq", tmp_path / "awq_out", stream=stream) == 0
    assert "converted AWQ checkpoint (gemv)" in stream.getvalue() and "rewritten as gemm" in stream.getvalue()


# -- progress and laziness ----------------------------------------------------------------------------------------

def test_dense_progress_per_layer_between_shards(tmp_path, rng):
    """With one layer per shard, each layer is quantized (and reported) right before its own shard is written."""
    make_dense(tmp_path / "src", rng, "F16", side=False)
    calls = []
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", max_shard_size=1,
                                progress=lambda done, total, desc: calls.append((done, total, desc)))
    layer_calls = [c for c in calls if c[2].startswith("quantized ")]
    n = len(result.quantized)
    assert n == 3 and layer_calls == [(i + 1, n, f"quantized {m}") for i, m in enumerate(result.quantized)]
    kinds = [c[2].split()[0] for c in calls]
    first = kinds.index("quantized")
    assert kinds[first:first + 2 * n] == ["quantized", "writing"] * n, kinds
    assert all(c[2].startswith(("quantized ", "writing model-")) for c in calls)


def test_awq_progress_per_layer(tmp_path, rng, capsys):
    make_awq(tmp_path / "src", rng, "gemv_fast", 256, 64, 128)
    calls = []
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out", progress=lambda *a: calls.append(a))
    first, second = result.quantized
    assert {first, second} == {UP, DOWN}
    assert calls == [(1, 1, "opening model.safetensors"), (1, 2, f"converting {first}"),
                     (2, 2, f"converting {second}"), (1, 1, "writing model.safetensors")]
    convert_checkpoint(tmp_path / "src", tmp_path / "out2", progress=True)
    assert f"[awq_cupy] converting {DOWN}" in capsys.readouterr().err
    convert_checkpoint(tmp_path / "src", tmp_path / "out3")              # small model, not a terminal: silent
    assert capsys.readouterr().err == ""


def test_dense_layers_are_quantized_one_at_a_time_while_writing(tmp_path, rng, monkeypatch):
    """PendingLayer is really lazy: no weight is quantized before the output file is opened, and when a layer is
    quantized the previous layer's codes are already gone."""
    make_dense(tmp_path / "src", rng, "F16", side=False)
    events, alive = [], []
    real_quantize, real_write = convert.quantize, checkpoint.write_file

    def counting_quantize(w, *args, **kwargs):
        events.append(("quantize", sum(r() is not None for r in alive)))
        qt = real_quantize(w, *args, **kwargs)
        alive.append(weakref.ref(qt.Q))
        return qt

    def logging_write(path, *args, **kwargs):
        events.append(("open", path.name))
        n = real_write(path, *args, **kwargs)
        events.append(("close", path.name))
        return n

    monkeypatch.setattr(convert, "quantize", counting_quantize)
    monkeypatch.setattr(checkpoint, "write_file", logging_write)
    result = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert events[0] == ("open", "model.safetensors") and events[-1] == ("close", "model.safetensors")
    assert events[1:-1] == [("quantize", 0)] * len(result.quantized)
    assert len(result.quantized) == 3 and all(r() is None for r in alive)
