"""Checkpoint I/O: the safetensors reader/writer, load_checkpoint (all formats, configs, errors), save_checkpoint.

Test checkpoints are written with the reference writer (``safetensors.numpy.save_file``) where they stand in for
files produced by AutoAWQ, and read back with ``safetensors.numpy.load_file`` where our writer's output must be
readable by everyone else.
"""
import json
import struct
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file as st_save_file

from awq_cupy import formats, safetensors_io
from awq_cupy.checkpoint import (
    Checkpoint, CheckpointError, FormatMismatchWarning, QuantConfig, QuantizedLayer, load_checkpoint,
    save_checkpoint,
)
from awq_cupy.quantize import quantize
from awq_cupy.safetensors_io import SafetensorsError, SafetensorsFile

from conftest import FIXTURES

BF16 = np.dtype(ml_dtypes.bfloat16)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
UP = "model.layers.0.mlp.up_proj"
DOWN = "model.layers.0.mlp.down_proj"


# -- helpers ------------------------------------------------------------------------------------------------------

def make_layer(rng, K, N, G, fmt, bias=True):
    """(QuantizedTensors, packed dict incl. bias) of a random layer in ``fmt``."""
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float16)
    qt = quantize(w, G, zero_point=fmt != "marlin")
    packed = formats.pack(qt.Q, qt.Z, qt.S, fmt, G)
    if bias:
        packed["bias"] = rng.standard_normal(N).astype(np.float16)
    return qt, packed


def write_checkpoint(d, tensors, quant=AWQ, *, config_file="config.json", shards=None, extra_config=None):
    """A checkpoint as AutoAWQ/transformers lay it out, written with the reference safetensors writer."""
    d.mkdir(parents=True, exist_ok=True)
    if quant is not None:
        if config_file == "config.json":
            cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, **(extra_config or {}),
                   "quantization_config": quant}
        else:
            cfg = quant
        (d / config_file).write_text(json.dumps(cfg))
    if shards is None:
        st_save_file(dict(tensors), d / "model.safetensors", metadata={"format": "pt"})
        return d
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st_save_file({n: tensors[n] for n in names}, d / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def prefixed(name, packed):
    return {f"{name}.{k}": v for k, v in packed.items()}


def assert_same_logical(layer_or_unpacked, qt):
    Q, Z, S = layer_or_unpacked[:3]
    assert np.array_equal(Q, qt.Q), "Q differs"
    assert np.array_equal(Z, qt.Z), "Z differs"
    assert np.array_equal(S.view(np.uint16), qt.S.view(np.uint16)), "S differs"


def assert_gemm_state_dict(path, name, K, N, G, bias):
    """Exactly WQLinear_GEMM's state dict entries, as read by the reference safetensors reader."""
    t = load_file(path)
    want = {f"{name}.qweight": (np.int32, (K, N // 8)), f"{name}.qzeros": (np.int32, (K // G, N // 8)),
            f"{name}.scales": (np.float16, (K // G, N))}
    if bias:
        want[f"{name}.bias"] = (np.float16, (N,))
    got = {k: (v.dtype.type, v.shape) for k, v in t.items() if k.startswith(name + ".")}
    assert got == want
    return t


# -- the safetensors reader / writer ------------------------------------------------------------------------------

def _all_dtypes(rng):
    return {
        "f64": rng.standard_normal((3, 2)),
        "f32": rng.standard_normal(5).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "bf16": rng.standard_normal((4, 3)).astype(np.float32).astype(BF16),
        "i64": rng.integers(-9, 9, 3), "u64": rng.integers(0, 9, 3).astype(np.uint64),
        "i32": rng.integers(-2**31, 2**31 - 1, (7,), dtype=np.int32), "u32": np.arange(3, dtype=np.uint32),
        "i16": np.arange(-3, 3, dtype=np.int16), "u16": np.arange(5, dtype=np.uint16),
        "i8": np.arange(-4, 3, dtype=np.int8), "u8": np.arange(9, dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float16),
    }


def test_reader_matches_reference_loader(tmp_path, rng):
    tensors = _all_dtypes(rng)
    st_save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt", "x": "y"})
    ref = load_file(tmp_path / "a.safetensors")
    f = SafetensorsFile(tmp_path / "a.safetensors")
    assert set(f.keys()) == set(ref) and f.metadata == {"format": "pt", "x": "y"}
    for name, want in ref.items():
        got = f[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
        assert not got.flags.writeable, name
    assert f.dtype_code("bf16") == "BF16" and f.info("f16").shape == (2, 3, 4)


def test_writer_output_loads_with_reference_reader(tmp_path, rng):
    tensors = _all_dtypes(rng)
    tensors["big_endian"] = np.arange(4, dtype=">i4")
    tensors["strided"] = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    safetensors_io.save_file(tmp_path / "b.safetensors", tensors, {"format": "pt"})
    ref = load_file(tmp_path / "b.safetensors")
    assert set(ref) == set(tensors)
    for name, want in tensors.items():
        got = ref[name]
        assert got.shape == want.shape and np.array_equal(got, want), name
    with safe_open(tmp_path / "b.safetensors", framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    assert not (tmp_path / "b.safetensors.tmp").exists()


def test_writer_declared_dtype_override_and_errors(tmp_path):
    bits = np.array([0x3F80, 0x4000], np.uint16)             # bf16 1.0, 2.0
    safetensors_io.save_file(tmp_path / "c.safetensors", {"w": bits}, dtypes={"w": "BF16"})
    assert load_file(tmp_path / "c.safetensors")["w"].astype(np.float32).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="not given"):
        safetensors_io.save_file(tmp_path / "d.safetensors", {"w": bits}, dtypes={"v": "BF16"})
    with pytest.raises(TypeError, match="no safetensors equivalent"):
        safetensors_io.save_file(tmp_path / "d.safetensors", {"w": np.zeros(2, np.complex128)})
    with pytest.raises(ValueError, match="declared"):
        safetensors_io.write_file(tmp_path / "d.safetensors", [("w", "F32", (3,))], lambda n: np.zeros(2, np.float32))
    assert not (tmp_path / "d.safetensors").exists() and not (tmp_path / "d.safetensors.tmp").exists()


def test_bf16_modes(tmp_path, rng, monkeypatch):
    x = rng.standard_normal((3, 4)).astype(np.float32).astype(BF16)
    st_save_file({"x": x}, tmp_path / "e.safetensors")
    auto = SafetensorsFile(tmp_path / "e.safetensors")["x"]
    bits = SafetensorsFile(tmp_path / "e.safetensors", bf16="uint16")["x"]
    ml = SafetensorsFile(tmp_path / "e.safetensors", bf16="ml_dtypes")["x"]
    assert auto.dtype == BF16 and ml.dtype == BF16 and bits.dtype == np.uint16
    assert np.array_equal(bits, x.view(np.uint16)) and np.array_equal(ml.view(np.uint16), x.view(np.uint16))
    # without ml_dtypes, "auto" falls back to bit patterns and "ml_dtypes" is refused
    monkeypatch.setattr(safetensors_io, "_ml_dtypes_module", lambda: None)
    assert SafetensorsFile(tmp_path / "e.safetensors")["x"].dtype == np.uint16
    with pytest.raises(ImportError, match="ml_dtypes"):
        SafetensorsFile(tmp_path / "e.safetensors", bf16="ml_dtypes")
    with pytest.raises(ValueError, match="bf16="):
        SafetensorsFile(tmp_path / "e.safetensors", bf16="float32")


def test_reader_is_lazy_memory_mapped(tmp_path):
    """Opening reads only the header; data is mapped, so a change on disk after opening is what get() sees."""
    a = np.arange(1024, dtype=np.int32)
    st_save_file({"a": a}, tmp_path / "f.safetensors")
    f = SafetensorsFile(tmp_path / "f.safetensors")
    data_start = f.info("a").begin
    with open(tmp_path / "f.safetensors", "r+b") as fh:   # rewrite the data in place, same size
        fh.seek(data_start)
        fh.write((-a).tobytes())
    got = f["a"]
    assert isinstance(got, np.memmap)
    assert np.array_equal(got, -a)


def test_opening_a_huge_checkpoint_reads_nothing(tmp_path, rng):
    """A 16 GiB embedding (a sparse file: no disk or RAM used) next to a real layer: opening touches headers only."""
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    header, off = {}, 0
    for n, a in prefixed(UP, packed).items():         # int32 tensors first, then fp16: naturally aligned
        header[n] = {"dtype": safetensors_io.dtype_code_of(a.dtype), "shape": list(a.shape),
                     "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    layer_bytes = b"".join(a.tobytes() for a in packed.values())
    big = 16 << 30
    header["model.embed_tokens.weight"] = {"dtype": "F16", "shape": [big // 2 // 4096, 4096],
                                           "data_offsets": [len(layer_bytes), len(layer_bytes) + big]}
    blob = json.dumps(header).encode()
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"quantization_config": AWQ}))
    with open(d / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob + layer_bytes)
        fh.truncate(8 + len(blob) + len(layer_bytes) + big)
    ckpt = load_checkpoint(d)
    emb = ckpt.tensors["model.embed_tokens.weight"]
    assert isinstance(emb, np.memmap) and emb.nbytes == big
    assert float(emb[-1, -1]) == 0.0                   # one page read on demand
    assert np.array_equal(ckpt.layers[UP].tensors["qweight"], packed["qweight"])


def _valid_file(tmp_path, name="g.safetensors"):
    st_save_file({"layer.qweight": np.arange(64, dtype=np.int32).reshape(8, 8)}, tmp_path / name)
    return tmp_path / name


def _rewrite_header(path, header: dict, data=b""):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("corrupt, match", [
    (lambda p: p.write_bytes(b"\x01\x02"), "too small"),
    (lambda p: p.write_bytes(struct.pack("<Q", 10**6) + b"{}"), "header length 1000000 exceeds the file size"),
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "'layer.qweight'.*beyond the end of the file"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{no "), "not valid UTF-8 JSON"),
    (lambda p: _rewrite_header(p, {"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 6]}}, b"\0" * 8),
     "'w'.*span 6 bytes but dtype F16 x shape \\[4\\] needs 8"),
    (lambda p: _rewrite_header(p, {"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 8),
     "'w'.*unknown dtype 'Q4'"),
    (lambda p: _rewrite_header(p, {"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                   "v": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 8),
     "overlap"),
    (lambda p: _rewrite_header(p, {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}), "'w'.*shape"),
    (lambda p: _rewrite_header(p, [1, 2]), "JSON object"),
])
def test_reader_rejects_corrupted_files(tmp_path, corrupt, match):
    p = _valid_file(tmp_path)
    corrupt(p)
    with pytest.raises(SafetensorsError, match=match) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


# -- load_checkpoint ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_load_each_format_matches_quantizer(tmp_path, rng, fmt):
    K, N, G = 256, 128, 128
    qt, packed = make_layer(rng, K, N, G, fmt)
    embed = rng.standard_normal((32, 64)).astype(np.float16)
    quant = {**AWQ, "version": fmt, "zero_point": fmt != "marlin"}
    write_checkpoint(tmp_path, {**prefixed(UP, packed), "model.embed_tokens.weight": embed}, quant)
    ckpt = load_checkpoint(tmp_path)
    assert isinstance(ckpt, Checkpoint) and ckpt.path == tmp_path
    assert ckpt.quant_config == QuantConfig(group_size=G, zero_point=fmt != "marlin", version=fmt,
                                            source=str(tmp_path / "config.json"))
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    layer = ckpt.layers[UP]
    assert isinstance(layer, QuantizedLayer)
    assert (layer.name, layer.format, layer.in_features, layer.out_features, layer.group_size) == (UP, fmt, K, N, G)
    assert set(layer.tensors) == set(packed) - {"bias"}
    assert all(isinstance(a, np.memmap) for a in layer.tensors.values())
    assert np.array_equal(layer.bias, packed["bias"])
    assert_same_logical(layer.unpack(), qt)
    assert list(ckpt.tensors) == ["model.embed_tokens.weight"]
    assert isinstance(ckpt.tensors["model.embed_tokens.weight"], np.memmap)
    assert np.array_equal(ckpt.tensors["model.embed_tokens.weight"], embed)


def test_single_file_path_with_sibling_config(tmp_path, rng):
    qt, packed = make_layer(rng, 256, 64, 64, "gemm", bias=False)
    write_checkpoint(tmp_path, prefixed(UP, packed), {**AWQ, "group_size": 64})
    ckpt = load_checkpoint(tmp_path / "model.safetensors")
    assert ckpt.layers[UP].bias is None and ckpt.path == tmp_path
    assert_same_logical(ckpt.layers[UP].unpack(), qt)


def test_sharded_checkpoint_with_index(tmp_path, rng):
    qt1, p1 = make_layer(rng, 256, 128, 128, "gemm")
    qt2, p2 = make_layer(rng, 128, 256, 128, "gemm")
    tensors = {**prefixed(UP, p1), **prefixed(DOWN, p2), "lm_head.weight": np.ones((8, 8), np.float16)}
    names = sorted(tensors)
    write_checkpoint(tmp_path, tensors, shards=[names[:3], names[3:]])
    ckpt = load_checkpoint(tmp_path)
    assert len(ckpt.files) == 2 and set(ckpt.layers) == {UP, DOWN}
    assert_same_logical(ckpt.layers[UP].unpack(), qt1)
    assert_same_logical(ckpt.layers[DOWN].unpack(), qt2)
    assert list(ckpt.tensors) == ["lm_head.weight"]


@pytest.mark.parametrize("config_file, quant", [
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}),
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4}),          # no version: gemm
    ("quantize_config.json", {"bits": 4, "group_size": 128, "zero_point": True, "version": "Gemm"}),
    ("config.json", {**AWQ, "version": "GEMM"}),
    ("config.json", {**AWQ, "version": "exllama"}),                                        # a gemm file on disk
])
def test_old_and_case_variant_configs(tmp_path, rng, config_file, quant):
    qt, packed = make_layer(rng, 256, 64, 128, "gemm")
    write_checkpoint(tmp_path, prefixed(UP, packed), quant, config_file=config_file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # the tag agrees with the tensors: no warning
        ckpt = load_checkpoint(tmp_path)
    qc = ckpt.quant_config
    assert (qc.bits, qc.group_size, qc.zero_point, qc.version) == (4, 128, True, "gemm")
    assert qc.source.endswith(config_file)
    assert_same_logical(ckpt.layers[UP].unpack(), qt)


def test_modules_to_not_convert(tmp_path, rng):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    gate = rng.standard_normal((8, 256)).astype(np.float16)
    quant = {**AWQ, "modules_to_not_convert": ["gate", "visual"]}
    write_checkpoint(tmp_path / "ok", {**prefixed(UP, packed), "model.layers.0.block_sparse_moe.gate.weight": gate},
                     quant)
    ckpt = load_checkpoint(tmp_path / "ok")
    assert ckpt.quant_config.modules_to_not_convert == ("gate", "visual")
    assert set(ckpt.layers) == {UP}                       # "up_proj" does not contain "gate"
    assert np.array_equal(ckpt.tensors["model.layers.0.block_sparse_moe.gate.weight"], gate)
    # a module that should stay unquantized but holds qweight is rejected
    write_checkpoint(tmp_path / "bad", prefixed("model.visual.proj", packed), quant)
    with pytest.raises(CheckpointError, match="'model.visual.proj'.*modules_to_not_convert"):
        load_checkpoint(tmp_path / "bad")


@pytest.mark.parametrize("K, N", [(256, 128), (384, 384)])
def test_gemv_tag_on_gemm_tensors_detection_wins(tmp_path, rng, K, N):
    qt, packed = make_layer(rng, K, N, 128, "gemm")
    write_checkpoint(tmp_path, {**prefixed(UP, packed), **prefixed(DOWN, packed)}, {**AWQ, "version": "gemv"})
    with pytest.warns(FormatMismatchWarning, match="version 'gemv'.*2 module.*gemm layout"):
        ckpt = load_checkpoint(tmp_path)
    assert {layer.format for layer in ckpt.layers.values()} == {"gemm"}
    assert_same_logical(ckpt.layers[UP].unpack(), qt)


def test_square_gemv_layer(tmp_path, rng):
    """K = N: gemm and gemv qweight shapes coincide; the scales shape tells them apart (docs/formats.md §Checkpoint pitfalls)."""
    qt, packed = make_layer(rng, 256, 256, 128, "gemv")
    assert packed["qweight"].shape == (256, 32)
    write_checkpoint(tmp_path, prefixed(UP, packed), {**AWQ, "version": "gemv"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = load_checkpoint(tmp_path)
    assert ckpt.layers[UP].format == "gemv"
    assert_same_logical(ckpt.layers[UP].unpack(), qt)


def _llm_awq_bf16_gemv_fast(rng, K=256, N=128, G=128):
    """llm-awq's current layout: gemv_fast with bf16 ``scales`` and ``scaled_zeros`` = bf16(-(S·Z))."""
    qt, packed = make_layer(rng, K, N, G, "gemv_fast", bias=False)
    S = qt.S.astype(np.float32).astype(BF16).astype(np.float32).astype(np.float16)   # bf16- and fp16-exact
    qt = qt._replace(S=S)
    packed = formats.pack(qt.Q, qt.Z, qt.S, "gemv_fast", G)
    ZW = formats.zeros_width(K, G)
    scales = np.zeros((8 * ZW, N), BF16)
    scales[: K // G] = S.astype(np.float32).astype(BF16)
    szeros = np.zeros((8 * ZW, N), BF16)
    szeros[: K // G] = (-(S.astype(np.float32) * qt.Z)).astype(BF16)
    bias = rng.standard_normal(N).astype(np.float32).astype(BF16)      # llm-awq: bias in the model dtype
    return qt, {"qweight": packed["qweight"], "scaled_zeros": szeros, "scales": scales, "bias": bias}


@pytest.mark.parametrize("bf16", ["uint16", "ml_dtypes"])
def test_llm_awq_bf16_gemv_fast_and_bf16_passthrough(tmp_path, rng, bf16):
    qt, packed = _llm_awq_bf16_gemv_fast(rng)
    norm = rng.standard_normal(64).astype(np.float32).astype(BF16)
    write_checkpoint(tmp_path / "src", {**prefixed(UP, packed), "model.norm.weight": norm},
                     {**AWQ, "version": "gemv_fast"})
    ckpt = load_checkpoint(tmp_path / "src", bf16=bf16)
    layer = ckpt.layers[UP]
    assert layer.format == "gemv_fast" and set(layer.tensors) == {"qweight", "scaled_zeros", "scales"}
    assert layer.dtype_codes["scales"] == layer.dtype_codes["bias"] == "BF16"
    assert layer.tensors["scales"].dtype == (np.uint16 if bf16 == "uint16" else BF16)
    assert_same_logical(layer.unpack(), qt)
    got_norm = ckpt.tensors["model.norm.weight"]
    assert got_norm.dtype == (np.uint16 if bf16 == "uint16" else BF16)
    assert np.array_equal(got_norm.view(np.uint16), norm.view(np.uint16))
    assert ckpt.tensors.dtype_code("model.norm.weight") == "BF16"
    # re-saving keeps BF16 on disk even when the arrays were bit patterns
    save_checkpoint(tmp_path / "out", ckpt.layers, ckpt.tensors, group_size=128, config=ckpt.config)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["model.norm.weight"].dtype == BF16
    assert np.array_equal(out["model.norm.weight"].view(np.uint16), norm.view(np.uint16))
    assert out[f"{UP}.bias"].dtype == np.float16                       # AutoAWQ gemm: fp16 bias
    assert np.array_equal(out[f"{UP}.bias"], packed["bias"].astype(np.float32).astype(np.float16))
    assert_same_logical(load_checkpoint(tmp_path / "out").layers[UP].unpack(), qt)


def test_progress_reporting(tmp_path, rng, capsys):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    write_checkpoint(tmp_path, prefixed(UP, packed))
    calls = []
    load_checkpoint(tmp_path, progress=lambda done, total, desc: calls.append((done, total, desc)))
    assert calls == [(1, 1, "opening model.safetensors")]
    load_checkpoint(tmp_path, progress=True)
    assert "[awq_cupy] opening model.safetensors 1/1" in capsys.readouterr().err
    load_checkpoint(tmp_path)                          # default: small checkpoint, not a TTY -> silent
    assert capsys.readouterr().err == ""


# -- load_checkpoint errors ---------------------------------------------------------------------------------------

def test_missing_paths_and_files(tmp_path, rng):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"quantization_config": AWQ}))
    with pytest.raises(CheckpointError, match="no weights found"):
        load_checkpoint(tmp_path / "empty")
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    write_checkpoint(tmp_path / "noconfig", prefixed(UP, packed), quant=None)
    with pytest.raises(CheckpointError, match="missing quantization config.*no config.json"):
        load_checkpoint(tmp_path / "noconfig")
    (tmp_path / "noconfig" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(CheckpointError, match="config.json has no 'quantization_config'"):
        load_checkpoint(tmp_path / "noconfig")
    (tmp_path / "noconfig" / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="config.json: cannot read JSON"):
        load_checkpoint(tmp_path / "noconfig")


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "quant_method 'compressed-tensors' is not supported"),
    ({**AWQ, "bits": 8}, "bits=8 is not supported"),
    ({"w_bit": 3, "q_group_size": 128}, "bits=3"),
    ({**AWQ, "version": "gptq"}, "unknown AWQ version 'gptq'"),
    ({**AWQ, "group_size": 0}, "group_size=0"),
    ({**AWQ, "zero_point": "yes"}, "zero_point"),
    ({**AWQ, "modules_to_not_convert": "gate"}, "modules_to_not_convert"),
])
def test_unsupported_configs(tmp_path, rng, quant, match):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    write_checkpoint(tmp_path, prefixed(UP, packed), quant)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


def test_index_errors(tmp_path, rng):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    tensors = prefixed(UP, packed)
    d = write_checkpoint(tmp_path / "a", tensors, shards=[sorted(tensors)[:2], sorted(tensors)[2:]])
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors'.*missing"):
        load_checkpoint(d)
    d = write_checkpoint(tmp_path / "b", tensors, shards=[sorted(tensors)])
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'lm_head.weight'.*no such tensor"):
        load_checkpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        load_checkpoint(d)


def test_truncated_and_corrupted_weights(tmp_path, rng):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    d = write_checkpoint(tmp_path, prefixed(UP, packed))
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*'.*beyond the end of the file"):
        load_checkpoint(d)
    f.write_bytes(data[:8] + b"\xff" * (len(data) - 8))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header is not valid UTF-8 JSON"):
        load_checkpoint(d)


def test_duplicate_tensor_across_unindexed_files(tmp_path, rng):
    _, packed = make_layer(rng, 256, 64, 128, "gemm")
    write_checkpoint(tmp_path, {})
    (tmp_path / "model.safetensors").unlink()
    st_save_file(prefixed(UP, packed), tmp_path / "a.safetensors")
    st_save_file({f"{UP}.bias": packed["bias"]}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.up_proj.bias' appears in both"):
        load_checkpoint(tmp_path)


def _broken(rng, what):
    _, p = make_layer(rng, 256, 64, 128, "gemm")
    if what == "no qzeros":
        del p["qzeros"]
    elif what == "no scales":
        del p["scales"]
    elif what == "group size":
        p["scales"], p["qzeros"] = p["scales"][:1], p["qzeros"][:1]     # G = 256 on disk, config says 128
    elif what == "scales dtype":
        p["scales"] = p["scales"].astype(np.float64)
    elif what == "bias shape":
        p["bias"] = p["bias"][:32]
    elif what == "qweight int8":
        p["qweight"] = np.zeros((256, 8), np.int8)
    elif what == "both zeros":
        p["scaled_zeros"] = p["scales"]
    elif what == "marlin with zeros":
        _, m = make_layer(rng, 256, 64, 128, "marlin")
        p = {**m, "qzeros": np.zeros((2, 8), np.int32)}
    return p


@pytest.mark.parametrize("what, match", [
    ("no qzeros", r"missing tensor model\.layers\.0\.mlp\.up_proj\.qzeros"),
    ("no scales", r"missing tensor model\.layers\.0\.mlp\.up_proj\.scales"),
    ("group size", r"model\.safetensors: tensor '.*up_proj\.qzeros' is I32 \[1, 8\], but a gemm layer with K=256, "
                   r"N=64, group_size=128 needs I32 \[2, 8\]"),
    ("scales dtype", r"'.*up_proj\.scales' is F64 \[2, 64\].*needs F16/BF16/F32"),
    ("bias shape", r"'.*up_proj\.bias' is F16 \[32\], expected a float vector of out_features N=64"),
    ("qweight int8", r"module 'model\.layers\.0\.mlp\.up_proj' .*unknown AWQ layout \(qweight I8 \[256, 8\]"),
    ("both zeros", "holds both"),
    ("marlin with zeros", "unknown AWQ layout"),
])
def test_inconsistent_layers(tmp_path, rng, what, match):
    write_checkpoint(tmp_path, prefixed(UP, _broken(rng, what)))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


# -- save_checkpoint ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, G", [("gemm", 64), ("gemm", -1), ("gemv", 128), ("gemv", 64), ("gemv", -1),
                                    ("gemv_fast", 128), ("marlin", 128), ("marlin", -1)])
@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_from_every_format(tmp_path, rng, fmt, G, bias):
    K, N = 256, 128
    qt, packed = make_layer(rng, K, N, G, fmt, bias=bias)
    norm = rng.standard_normal(64).astype(np.float32)
    d = save_checkpoint(tmp_path / "out", {UP: packed}, {"model.norm.weight": norm}, group_size=G,
                        config={"architectures": ["X"]}, zero_point=fmt != "marlin")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["X"]
    assert cfg["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G,
                                          "zero_point": fmt != "marlin", "modules_to_not_convert": None}
    Gr = K if G == -1 else G
    t = assert_gemm_state_dict(d / "model.safetensors", UP, K, N, Gr, bias)
    assert set(t) == {f"{UP}.{k}" for k in ("qweight", "qzeros", "scales")} | ({f"{UP}.bias"} if bias else set()) | {
        "model.norm.weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = load_checkpoint(d)
    layer = ckpt.layers[UP]
    assert (layer.format, layer.group_size, layer.config_group_size) == ("gemm", Gr, G)
    assert_same_logical(layer.unpack(), qt)
    if bias:
        assert np.array_equal(layer.bias, packed["bias"])
    else:
        assert layer.bias is None
    assert np.array_equal(ckpt.tensors["model.norm.weight"], norm)
    if fmt != "marlin":
        # AutoAWQ's own packed gemm tensors are what we wrote, bit for bit
        ref = formats.pack(qt.Q, qt.Z, qt.S, "gemm", G)
        for k in ref:
            assert np.array_equal(t[f"{UP}.{k}"], ref[k]), k


def test_save_quantized_tensors_and_loaded_layers(tmp_path, rng):
    qt1, _ = make_layer(rng, 256, 128, 128, "gemm")
    qt2, p2 = make_layer(rng, 128, 256, 128, "gemv")
    bias1 = rng.standard_normal(128).astype(np.float32)         # stored as fp16, like AutoAWQ
    write_checkpoint(tmp_path / "gemv", prefixed(DOWN, p2), {**AWQ, "version": "gemv"})
    src = load_checkpoint(tmp_path / "gemv")
    d = save_checkpoint(tmp_path / "out", {UP: qt1, DOWN: src.layers[DOWN]}, {f"{UP}.bias": bias1},
                        group_size=128)
    t = assert_gemm_state_dict(d / "model.safetensors", UP, 256, 128, 128, True)
    assert np.array_equal(t[f"{UP}.bias"], bias1.astype(np.float16))
    assert_gemm_state_dict(d / "model.safetensors", DOWN, 128, 256, 128, True)
    ckpt = load_checkpoint(d)
    assert_same_logical(ckpt.layers[UP].unpack(), qt1)
    assert_same_logical(ckpt.layers[DOWN].unpack(), qt2)
    assert np.array_equal(ckpt.layers[DOWN].bias, p2["bias"]) and len(ckpt.tensors) == 0


def test_save_sharded(tmp_path, rng):
    layers = {f"model.layers.{i}.mlp.up_proj": make_layer(rng, 256, 128, 128, "gemm") for i in range(4)}
    others = {"model.embed_tokens.weight": rng.standard_normal((64, 32)).astype(np.float16),
              "model.rope.inv_freq": rng.standard_normal(16),                                 # float64 first
              "model.mask": np.array([True, False, True])}                                   # odd size last
    d = save_checkpoint(tmp_path, {k: v[1] for k, v in layers.items()}, others, group_size=128,
                        max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (d / "model.safetensors").exists()
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for s in shards:
        t = load_file(d / s)
        assert all(index["weight_map"][n] == s for n in t)
        total += sum(v.nbytes for v in t.values())
        for n in t:   # a layer never straddles shards
            prefix = n.rsplit(".", 1)[0]
            if prefix in layers:
                assert {f"{prefix}.{k}" for k in ("qweight", "qzeros", "scales", "bias")} <= set(t)
        with SafetensorsFile(d / s) as f:   # natural alignment of every tensor
            assert all(f.info(n).begin % f.numpy_dtype(n).itemsize == 0 for n in f)
    assert index["metadata"]["total_size"] == total
    ckpt = load_checkpoint(d)
    assert len(ckpt.files) == len(shards) and set(ckpt.layers) == set(layers)
    for name, (qt, packed) in layers.items():
        assert_same_logical(ckpt.layers[name].unpack(), qt)
        assert np.array_equal(ckpt.layers[name].bias, packed["bias"])
    assert all(np.array_equal(ckpt.tensors[k], v) for k, v in others.items())


def test_save_overwrite_rules(tmp_path, rng):
    qt, packed = make_layer(rng, 256, 128, 128, "gemm")
    save_checkpoint(tmp_path, {UP: packed, DOWN: packed}, group_size=128, max_shard_size=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(tmp_path, {UP: qt}, group_size=128)
    save_checkpoint(tmp_path, {UP: qt}, group_size=128, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert set(load_checkpoint(tmp_path).layers) == {UP}


def test_save_modules_to_not_convert(tmp_path, rng):
    qt, _ = make_layer(rng, 256, 128, 128, "gemm")
    gate = np.ones((8, 256), np.float16)
    save_checkpoint(tmp_path, {UP: qt}, {"model.layers.0.mlp.gate.weight": gate}, group_size=128,
                    modules_to_not_convert=["gate"])
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.quant_config.modules_to_not_convert == ("gate",)
    assert list(ckpt.tensors) == ["model.layers.0.mlp.gate.weight"]
    with pytest.raises(ValueError, match="matches modules_to_not_convert"):
        save_checkpoint(tmp_path / "x", {"model.layers.0.mlp.gate": qt}, group_size=128,
                        modules_to_not_convert=["gate"])


@pytest.mark.parametrize("case, exc, match", [
    ("group size", ValueError, r"group size 64 differs from group_size=128"),
    ("bias twice", ValueError, "bias given twice"),
    ("collision", ValueError, "collides"),
    ("not symmetric", ValueError, "zero_point=False needs every zero point to be 8"),
    ("shard size", ValueError, "max_shard_size"),
    ("layer type", TypeError, "expected QuantizedTensors"),
    ("bad group", ValueError, "group_size=0"),
])
def test_save_rejects(tmp_path, rng, case, exc, match):
    qt, packed = make_layer(rng, 256, 128, 128, "gemm")
    kwargs = dict(group_size=128)
    layers, others = {UP: packed}, {}
    if case == "group size":
        layers = {UP: make_layer(rng, 256, 128, 64, "gemm")[0]}
    elif case == "bias twice":
        others = {f"{UP}.bias": packed["bias"]}
    elif case == "collision":
        layers, others = {UP: qt}, {f"{UP}.qweight": packed["qweight"]}
    elif case == "not symmetric":
        kwargs["zero_point"] = False
    elif case == "shard size":
        kwargs["max_shard_size"] = "lots"
    elif case == "layer type":
        layers = {UP: np.zeros(3)}
    elif case == "bad group":
        kwargs["group_size"] = 0
    with pytest.raises(exc, match=match):
        save_checkpoint(tmp_path / "out", layers, others, **kwargs)
    leftovers = list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else []
    assert not [p for p in leftovers if p.suffix in (".safetensors", ".tmp", ".json")], leftovers


# -- AutoAWQ's own files --------------------------------------------------------------------------------------------

FIXTURE_INDEX = json.loads((FIXTURES / "index.json").read_text())


@pytest.mark.parametrize("e", FIXTURE_INDEX, ids=[e["file"].removesuffix(".safetensors") for e in FIXTURE_INDEX])
def test_autoawq_fixture_files_load_and_convert_to_gemm(tmp_path, e):
    """Each golden file is one AutoAWQ layer with bare tensor names (module ''). Detection must find its format,
    and the gemm checkpoint we write from it must dequantize to AutoAWQ's fake-quantized weight."""
    fmt, K, N, G = e["format"], e["in_features"], e["out_features"], e["group_size"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes((FIXTURES / e["file"]).read_bytes())
    (src / "config.json").write_text(json.dumps({"quantization_config": {
        **AWQ, "version": fmt.upper(), "group_size": G, "zero_point": fmt != "marlin"}}))
    ckpt = load_checkpoint(src)
    layer = ckpt.layers[""]
    assert (layer.format, layer.in_features, layer.out_features, layer.config_group_size) == (fmt, K, N, G)
    assert set(ckpt.tensors) == {"weight_original", "weight_fake_quant", "bias_in"}
    d = save_checkpoint(tmp_path / "out", ckpt.layers, {}, group_size=G, zero_point=fmt != "marlin")
    out = load_checkpoint(d).layers[""]
    assert out.format == "gemm"
    w = out.unpack().fake_quant()
    want = ckpt.tensors["weight_fake_quant"] + np.float16(0)       # +0.0: marlin's -0.0 (see test_quantize)
    assert np.array_equal(w.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(out.bias, ckpt.tensors["bias_in"])
