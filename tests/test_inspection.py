"""awq_cupy.inspection: layer facts from the headers, value problems found where they were put, exit codes.

Checkpoints are built the way tests/test_checkpoint.py builds them: ``quantize`` + ``save_checkpoint`` for gemm,
and ``formats.pack`` + ``safetensors_io.save_file`` with a ``config.json`` for the other layouts. Faults are
injected into the *logical* tensors (group g, column n) before packing wherever the layout allows it, so each
expected location is known independently of the layout code under test. Expected byte counts come from the shapes
of docs/formats.md §Layouts at a glance, not from the library. CPU only.
"""
import io
import json
import warnings

import ml_dtypes
import numpy as np
import pytest

from awq_cupy import formats, inspection, save_checkpoint, safetensors_io
from awq_cupy.checkpoint import CheckpointError, CheckpointWarning
from awq_cupy.inspection import LayerInfo, Rule, Severity, inspect_checkpoint, main
from awq_cupy.quantize import quantize

BF16 = np.dtype(ml_dtypes.bfloat16)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
UP = "model.layers.0.mlp.up_proj"


# -- helpers ------------------------------------------------------------------------------------------------------

def logical(rng, K, N, G, zero_point=True):
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float16)
    return quantize(w, G, zero_point=zero_point)


def write_checkpoint(d, tensors, quant=AWQ, dtypes=None):
    """model.safetensors + config.json, as AutoAWQ lays them out."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": quant}))
    safetensors_io.save_file(d / "model.safetensors", tensors, {"format": "pt"}, dtypes=dtypes)
    return d


def prefixed(name, packed):
    return {f"{name}.{k}": v for k, v in packed.items()}


def gemm_nbytes(K, N, G, bias):
    """qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N], bias fp16 [N]."""
    NG = K // G
    return 4 * K * (N // 8) + 4 * NG * (N // 8) + 2 * NG * N + (2 * N if bias else 0)


def one_layer(tmp_path, fmt, qt, *, G, S=None, Z=None, quant=None, bias=None, edit=None, dtypes=None):
    """A checkpoint holding ``UP`` in ``fmt``, from logical ``qt`` with S/Z replaced where given."""
    packed = formats.pack(qt.Q, qt.Z if Z is None else Z, qt.S if S is None else S, fmt, G)
    if bias is not None:
        packed["bias"] = bias
    if edit is not None:
        edit(packed)
    quant = quant or {**AWQ, "group_size": G, "version": fmt, "zero_point": fmt != "marlin"}
    return write_checkpoint(tmp_path / "ckpt", prefixed(UP, packed), quant,
                            dtypes={f"{UP}.{k}": v for k, v in (dtypes or {}).items()})


def run_main(path, **kw):
    out = io.StringIO()
    rc = main(path, stream=out, **kw)
    return rc, out.getvalue()


def only(report):
    assert len(report.problems) == 1, report.problems
    return report.problems[0]


# -- a clean checkpoint -------------------------------------------------------------------------------------------

def test_clean_multi_layer_checkpoint(tmp_path, rng, monkeypatch, capsys):
    G = 64
    shapes = {"model.layers.10.self_attn.o_proj": (256, 64, True), "model.layers.2.mlp.up_proj": (128, 256, False),
              "model.layers.2.mlp.down_proj": (256, 128, True)}
    layers = {n: logical(rng, K, N, G) for n, (K, N, _) in shapes.items()}
    other = {f"{n}.bias": rng.standard_normal(N).astype(np.float16) for n, (_, N, b) in shapes.items() if b}
    other["model.embed_tokens.weight"] = rng.standard_normal((32, 64)).astype(np.float16)
    other["model.norm.weight"] = np.ones(64, np.float32)
    d = save_checkpoint(tmp_path / "ckpt", layers, other, group_size=G)
    # the scan reads scales and zeros only: unpacking a layer (which decodes qweight) is never needed
    monkeypatch.setattr(formats, "unpack", lambda *a, **k: pytest.fail("inspection unpacked a layer"))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = inspect_checkpoint(d)
    want = [LayerInfo(name=n, format="gemm", in_features=K, out_features=N, group_size=G, config_group_size=G,
                      nbytes=gemm_nbytes(K, N, G, b), has_bias=b,
                      dtypes={"qweight": "I32", "qzeros": "I32", "scales": "F16", **({"bias": "F16"} if b else {})},
                      source="model.safetensors")
            for n, (K, N, b) in [(n, shapes[n]) for n in ("model.layers.2.mlp.down_proj", "model.layers.2.mlp.up_proj",
                                                          "model.layers.10.self_attn.o_proj")]]
    assert list(report.layers) == want                 # natural order: layers.2 before layers.10
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in report.tensors] == [
        ("model.embed_tokens.weight", "F16", (32, 64), 32 * 64 * 2), ("model.norm.weight", "F32", (64,), 64 * 4)]
    assert report.problems == () and report.ok and report.scanned
    assert report.layers_per_format == {"gemm": 3}
    assert report.quantized_nbytes == sum(gemm_nbytes(K, N, G, b) for K, N, b in shapes.values())
    assert report.other_nbytes == 32 * 64 * 2 + 64 * 4
    assert report.quant_config.group_size == G and report.files == (d / "model.safetensors",)

    rc, text = run_main(d)
    assert rc == 0 and capsys.readouterr().err == ""
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith("model.layers.")}
    assert rows == {n: [n, "gemm", str(K), str(N), str(G), str(gemm_nbytes(K, N, G, b)), "yes" if b else "no"]
                    for n, (K, N, b) in shapes.items()}
    assert "model.embed_tokens.weight" in text and "model.norm.weight" in text
    assert text.splitlines()[-1] == "no problems found"

    rc, out = run_main(d, as_json=True)
    data = json.loads(out)
    assert rc == 0 and data["ok"] is True and data["problems"] == [] and data["schema"] == inspection.SCHEMA_VERSION
    assert data["layers"] == [layer.to_dict() for layer in want]
    assert data["summary"] == {"layers": 3, "layers_per_format": {"gemm": 3}, "quantized_nbytes":
                               report.quantized_nbytes, "other_tensors": 2, "other_nbytes": 32 * 64 * 2 + 64 * 4,
                               "errors": 0, "warnings": 0}
    assert data["quant_config"]["zero_point"] is True and data["quant_config"]["group_size"] == G


@pytest.mark.parametrize("fmt, K, N, G", [("gemm", 256, 64, 128), ("gemv", 256, 64, 64), ("gemv_fast", 256, 64, 128),
                                          ("marlin", 256, 128, 128), ("marlin", 256, 128, -1)])
def test_each_format_clean(tmp_path, rng, fmt, K, N, G):
    qt = logical(rng, K, N, G, zero_point=fmt != "marlin")
    bias = rng.standard_normal(N).astype(np.float16)
    d = one_layer(tmp_path, fmt, qt, G=G, bias=bias)
    packed = formats.pack(qt.Q, qt.Z, qt.S, fmt, G)
    report = inspect_checkpoint(d)
    (layer,) = report.layers
    assert (layer.format, layer.in_features, layer.out_features) == (fmt, K, N)
    assert (layer.group_size, layer.config_group_size) == (K if G == -1 else G, G)
    assert layer.nbytes == sum(a.nbytes for a in packed.values()) + 2 * N and layer.has_bias
    assert report.problems == () and report.ok


@pytest.mark.parametrize("bf16", ["uint16", "ml_dtypes"])
def test_llm_awq_bf16_gemv_fast_clean(tmp_path, rng, bf16):
    d, _, _ = _bf16_gemv_fast(tmp_path, rng)
    report = inspect_checkpoint(d, bf16=bf16)
    assert report.layers[0].dtypes == {"qweight": "I16", "scaled_zeros": "BF16", "scales": "BF16"}
    assert report.problems == ()


def _bf16_gemv_fast(tmp_path, rng, K=256, N=64, G=128, edit=None):
    """llm-awq's layout: gemv_fast with bf16 ``scales`` and ``scaled_zeros`` = bf16(-(S*Z)), as in
    tests/test_checkpoint.py."""
    qt = logical(rng, K, N, G)
    S = qt.S.astype(np.float32).astype(BF16).astype(np.float32)                      # bf16-exact
    ZW = formats.zeros_width(K, G)
    scales = np.zeros((8 * ZW, N), BF16)
    scales[: K // G] = S.astype(BF16)
    szeros = np.zeros((8 * ZW, N), BF16)
    szeros[: K // G] = (-(S * qt.Z)).astype(BF16)
    if edit is not None:
        edit(S, szeros)
    packed = formats.pack(qt.Q, qt.Z, S.astype(np.float16), "gemv_fast", G)
    tensors = {"qweight": packed["qweight"], "scaled_zeros": szeros, "scales": scales}
    return write_checkpoint(tmp_path / "ckpt", prefixed(UP, tensors), {**AWQ, "version": "gemv_fast"}), qt, S


# -- value problems -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, K, N, G", [("gemm", 256, 64, 64), ("gemv", 256, 64, 128), ("gemv_fast", 256, 64, 128),
                                          ("marlin", 256, 128, 64), ("marlin", 256, 128, -1)])
def test_nan_scale_at_the_last_group_and_column(tmp_path, rng, capsys, fmt, K, N, G):
    qt = logical(rng, K, N, G, zero_point=fmt != "marlin")
    NG = 1 if G == -1 else K // G
    S = qt.S.copy()
    S[NG - 1, N - 1] = np.nan
    S[0, 37] = np.inf                                  # column 37: moved by every marlin permutation
    d = one_layer(tmp_path, fmt, qt, G=G, S=S)
    report = inspect_checkpoint(d)
    p = only(report)
    assert (p.severity, p.rule, p.where, p.count, p.index) == (Severity.ERROR, Rule.NONFINITE_SCALE, UP, 2, (0, 37))
    assert "1 NaN, 1 +Inf" in p.message and "group 0, column 37: inf" in p.message
    S[0, 37] = qt.S[0, 37]
    one_layer(tmp_path, fmt, qt, G=G, S=S)
    p = only(inspect_checkpoint(d))
    assert (p.count, p.index) == (1, (NG - 1, N - 1)) and f"group {NG - 1}, column {N - 1}: nan" in p.message
    rc, text = run_main(d)
    assert rc == 1 and "error   NONFINITE_SCALE " + UP in text and text.splitlines()[-1] == \
        "1 problem (1 error, 0 warnings)"
    assert capsys.readouterr().err == ""


def test_zero_and_negative_scales(tmp_path, rng):
    K, N, G = 256, 64, 128
    qt = logical(rng, K, N, G)
    S = qt.S.copy()
    S[0, 5] = 0
    S[1, 0] = -S[1, 0]
    d = one_layer(tmp_path, "gemm", qt, G=G, S=S)
    p = only(inspect_checkpoint(d))
    assert (p.rule, p.severity, p.where, p.count, p.index) == (Rule.NONPOSITIVE_SCALE, Severity.ERROR, UP, 2, (0, 5))
    assert "(1 zero, 1 negative)" in p.message
    assert run_main(d)[0] == 1


@pytest.mark.parametrize("bf16", ["uint16", "ml_dtypes"])
def test_inf_in_bf16_scales(tmp_path, rng, bf16):
    K, N, G = 256, 64, 64
    qt = logical(rng, K, N, G)
    scales = qt.S.astype(np.float32).astype(BF16)
    scales[3, 63] = -np.inf
    scales[3, 10] = np.inf
    d = one_layer(tmp_path, "gemm", qt, G=G, edit=lambda p: p.update(scales=scales))
    report = inspect_checkpoint(d, bf16=bf16)
    assert report.layers[0].dtypes["scales"] == "BF16"
    p = only(report)
    assert (p.rule, p.count, p.index) == (Rule.NONFINITE_SCALE, 2, (3, 10))
    assert "(0 NaN, 1 +Inf, 1 -Inf)" in p.message


@pytest.mark.parametrize("zero_point", [True, False])
def test_gemv_fast_zero_out_of_range_and_not_an_integer(tmp_path, rng, zero_point):
    K, N, G = 256, 64, 128
    qt = logical(rng, K, N, G, zero_point=zero_point)     # symmetric: the bad zeros are not also "not 8"
    S32 = qt.S.astype(np.float32)

    def edit(packed):
        sz = packed["qzeros"].copy()
        sz[1, N - 1] = np.float16(-(S32[1, N - 1] * 17))            # Z = 17: no 4-bit code
        sz[0, 3] = np.float16(-(S32[0, 3] * 3.5))                    # between two codes
        packed["qzeros"] = sz

    d = one_layer(tmp_path, "gemv_fast", qt, G=G, edit=edit,
                  quant={**AWQ, "version": "gemv_fast", "zero_point": zero_point})
    report = inspect_checkpoint(d)
    got = {p.rule: p for p in report.problems}
    assert len(report.problems) == 2
    assert set(got) == {Rule.ZERO_OUT_OF_RANGE, Rule.ZERO_NOT_INTEGER}
    assert (got[Rule.ZERO_OUT_OF_RANGE].index, got[Rule.ZERO_OUT_OF_RANGE].count) == ((1, N - 1), 1)
    assert "(rounds to 17)" in got[Rule.ZERO_OUT_OF_RANGE].message
    assert (got[Rule.ZERO_NOT_INTEGER].index, got[Rule.ZERO_NOT_INTEGER].count) == ((0, 3), 1)
    assert all(p.severity is Severity.ERROR and p.where == UP for p in report.problems)
    with pytest.raises(formats.FormatError):                          # what the check stands for: awq_cupy refuses it
        formats.unpack(formats.pack(qt.Q, qt.Z, qt.S, "gemv_fast", G) | {"qzeros": _sz(d)}, "gemv_fast", K, G)
    assert run_main(d)[0] == 1


def _sz(d):
    return safetensors_io.SafetensorsFile(d / "model.safetensors")[f"{UP}.qzeros"]


@pytest.mark.parametrize("bf16", ["uint16", "ml_dtypes"])
def test_bf16_scaled_zero_out_of_range(tmp_path, rng, bf16):
    def edit(S, szeros):
        szeros[0, 0] = np.float32(S[0, 0] * 2)                      # +S*2 means Z = -2

    d, _, _ = _bf16_gemv_fast(tmp_path, rng, edit=edit)
    p = only(inspect_checkpoint(d, bf16=bf16))
    assert (p.rule, p.index, p.count) == (Rule.ZERO_OUT_OF_RANGE, (0, 0), 1) and "scaled_zeros" in p.message


@pytest.mark.parametrize("fmt", ["gemm", "gemv", "gemv_fast"])
def test_symmetric_config_with_other_zero_points(tmp_path, rng, fmt):
    K, N, G = 256, 64, 128
    qt = logical(rng, K, N, G, zero_point=False)
    assert (qt.Z == 8).all()
    quant = {**AWQ, "version": fmt, "zero_point": False}
    d = one_layer(tmp_path, fmt, qt, G=G, quant=quant)
    assert inspect_checkpoint(d).problems == ()                      # all 8: as symmetric as it says
    Z = qt.Z.copy()
    Z[0, 9] = 7                                                      # gemm: column 9 sits in slot 4 of word 1
    Z[1, N - 1] = 0
    d = one_layer(tmp_path, fmt, qt, G=G, Z=Z, quant=quant)
    p = only(inspect_checkpoint(d))
    assert (p.rule, p.severity, p.where, p.count, p.index) == (Rule.ASYMMETRIC_ZERO, Severity.ERROR, UP, 2, (0, 9))
    assert "group 0, column 9: 7" in p.message
    assert run_main(d)[0] == 1
    # the same zeros under zero_point true are an ordinary asymmetric layer
    assert inspect_checkpoint(one_layer(tmp_path, fmt, qt, G=G, Z=Z, quant={**quant, "zero_point": True})).ok


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_nan_bias(tmp_path, rng, dtype):
    K, N, G = 256, 64, 128
    qt = logical(rng, K, N, G)
    bias = rng.standard_normal(N).astype(np.float32)
    bias[N - 1] = np.nan
    d = one_layer(tmp_path, "gemm", qt, G=G, bias=bias.astype(dtype))
    p = only(inspect_checkpoint(d, bf16="uint16"))
    assert (p.rule, p.severity, p.where, p.count, p.index) == (Rule.NONFINITE_BIAS, Severity.ERROR, UP, 1, (N - 1,))
    assert f"column {N - 1}: nan" in p.message
    assert run_main(d)[0] == 1


def test_an_unreadable_layer_is_one_problem_and_the_others_are_still_scanned(tmp_path, rng, monkeypatch):
    K, N, G = 256, 64, 128
    layers = {f"model.layers.{i}.mlp.up_proj": logical(rng, K, N, G) for i in range(2)}
    bad = layers["model.layers.1.mlp.up_proj"]
    S = bad.S.copy()
    S[0, 0] = np.nan
    layers["model.layers.1.mlp.up_proj"] = bad._replace(S=S)
    d = save_checkpoint(tmp_path / "ckpt", layers, group_size=G)
    real = inspection._logical_scales

    def flaky(layer):
        if layer.name == "model.layers.0.mlp.up_proj":
            raise OSError("Input/output error")
        return real(layer)

    monkeypatch.setattr(inspection, "_logical_scales", flaky)
    report = inspect_checkpoint(d)
    assert [(p.rule, p.where) for p in report.problems] == [
        (Rule.UNREADABLE, "model.layers.0.mlp.up_proj"), (Rule.NONFINITE_SCALE, "model.layers.1.mlp.up_proj")]
    assert "OSError: Input/output error" in report.problems[0].message and not report.ok


# -- what load_checkpoint warns about -----------------------------------------------------------------------------

def test_orphan_zeros_and_scales(tmp_path, rng):
    K, N, G = 256, 64, 128
    qt = logical(rng, K, N, G)
    packed = formats.pack(qt.Q, qt.Z, qt.S, "gemm", G)
    lost = "model.layers.1.mlp.down_proj"
    tensors = {**prefixed(UP, packed), f"{lost}.qzeros": packed["qzeros"], f"{lost}.scales": packed["scales"],
               "model.layers.0.mlp.act.scales": np.ones(4 * N, np.float16)}     # a scaled activation: legitimate
    d = write_checkpoint(tmp_path / "ckpt", tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # the loader's warning becomes a problem, it is not shown
        report = inspect_checkpoint(d)
    p = only(report)
    assert (p.rule, p.severity, p.where, p.count) == (Rule.ORPHAN_TENSOR, Severity.WARNING, lost, 2)
    assert "qzeros, scales" in p.message and report.ok and [layer.name for layer in report.layers] == [UP]
    assert {t.name for t in report.tensors} == {f"{lost}.qzeros", f"{lost}.scales", "model.layers.0.mlp.act.scales"}
    rc, text = run_main(d)
    assert rc == 0 and f"warning ORPHAN_TENSOR {lost}: " in text
    assert text.splitlines()[-1] == "1 problem (0 errors, 1 warning)"


def test_only_orphans_gives_two_warnings_and_nothing_else(tmp_path, rng):
    qt = logical(rng, 256, 64, 128)
    packed = formats.pack(qt.Q, qt.Z, qt.S, "gemm", 128)
    d = write_checkpoint(tmp_path / "ckpt", {f"{UP}.qzeros": packed["qzeros"], f"{UP}.scales": packed["scales"]})
    report = inspect_checkpoint(d)
    assert [(p.rule, p.where) for p in report.problems] == [(Rule.ORPHAN_TENSOR, UP),
                                                            (Rule.NO_QUANTIZED_LAYERS, str(d))]
    assert report.ok


def test_dense_checkpoint_with_a_quantization_config(tmp_path, rng):
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((8, 16)).astype(np.float16)
               for i in range(3)}
    d = write_checkpoint(tmp_path / "ckpt", tensors)
    report = inspect_checkpoint(d)
    p = only(report)
    assert (p.rule, p.severity, p.where) == (Rule.NO_QUANTIZED_LAYERS, Severity.WARNING, str(d))
    assert report.layers == () and len(report.tensors) == 3 and report.ok
    rc, text = run_main(d)
    assert rc == 0 and "0 quantized layers" in text and "model.layers.2.mlp.up_proj.weight" in text


def test_group_sizes_the_gpu_kernels_refuse(tmp_path, rng):
    from awq_cupy.weight import check_group_size

    layers = {f"model.layers.{i}.mlp.up_proj": logical(rng, 256, 64, 16) for i in range(3)}
    d = save_checkpoint(tmp_path / "ckpt", layers, group_size=16)      # valid AWQ: G a multiple of 8
    report = inspect_checkpoint(d)
    p = only(report)
    assert (p.rule, p.severity, p.where, p.count) == (Rule.GROUP_SIZE_NOT_ON_GPU, Severity.WARNING, str(d), 3)
    assert "group size 16 (3 layers: model.layers.0.mlp.up_proj" in p.message and report.ok
    with pytest.raises(ValueError, match="group_size=16 is not supported"):   # the check the GPU path makes
        check_group_size(256, 16)
    one = save_checkpoint(tmp_path / "one", {UP: logical(rng, 256, 64, 16)}, group_size=16)
    assert [(q.rule, q.where, q.count) for q in inspect_checkpoint(one).problems] == [
        (Rule.GROUP_SIZE_NOT_ON_GPU, UP, 1)]
    rc, text = run_main(one)
    assert rc == 0 and f"warning GROUP_SIZE_NOT_ON_GPU {UP}: group size 16 (1 layer: {UP})" in text
    for G in (32, 96):          # multiples of 32 run on the GPU
        ok = save_checkpoint(tmp_path / f"g{G}", {UP: logical(rng, 192 if G == 96 else 256, 64, G)}, group_size=G)
        assert inspect_checkpoint(ok).problems == ()


def test_version_tag_contradicting_the_layout(tmp_path, rng):
    layers = {f"model.layers.{i}.mlp.up_proj": logical(rng, 256, 64, 128) for i in range(2)}
    d = save_checkpoint(tmp_path / "ckpt", layers, group_size=128)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["version"] = "GEMV"
    (d / "config.json").write_text(json.dumps(cfg))
    p = only(inspect_checkpoint(d))
    assert (p.rule, p.severity, p.where, p.count) == (Rule.FORMAT_MISMATCH, Severity.WARNING,
                                                      str(d / "config.json"), 2)
    assert "'gemv'" in p.message and "gemm layout" in p.message
    assert run_main(d)[0] == 0


def test_unknown_loader_warnings_are_kept_and_others_passed_on(tmp_path, rng, monkeypatch):
    d = save_checkpoint(tmp_path / "ckpt", {UP: logical(rng, 256, 64, 128)}, group_size=128)
    real = inspection.load_checkpoint

    def noisy(*a, **k):
        warnings.warn("a new kind of doubt", CheckpointWarning)
        warnings.warn("not about the checkpoint", DeprecationWarning)
        return real(*a, **k)

    monkeypatch.setattr(inspection, "load_checkpoint", noisy)
    with pytest.warns(DeprecationWarning, match="not about the checkpoint") as seen:
        report = inspect_checkpoint(d)
    assert not [w for w in seen if issubclass(w.category, CheckpointWarning)]
    p = only(report)
    assert (p.rule, p.severity) == (Rule.CHECKPOINT_WARNING, Severity.WARNING)
    assert p.message == "CheckpointWarning: a new kind of doubt"


# -- unreadable checkpoints, options ------------------------------------------------------------------------------

def test_missing_and_corrupt_checkpoints_exit_2(tmp_path, rng, capsys):
    rc, out = run_main(tmp_path / "nope")
    err = capsys.readouterr().err
    assert (rc, out) == (2, "") and err == f"error: checkpoint path {tmp_path / 'nope'} does not exist\n"
    d = save_checkpoint(tmp_path / "ckpt", {UP: logical(rng, 256, 64, 128)}, group_size=128)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    rc, out = run_main(d, as_json=True)
    err = capsys.readouterr().err
    assert (rc, out) == (2, "") and err.startswith("error: ") and "beyond the end of the file" in err
    assert "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(CheckpointError):              # the library call raises; main is what turns it into 2
        inspect_checkpoint(d)


def test_scan_false_reads_no_values(tmp_path, rng):
    qt = logical(rng, 256, 64, 128)
    S = qt.S.copy()
    S[0, 0] = np.nan
    d = one_layer(tmp_path, "gemm", qt, G=128, S=S)
    calls = []
    report = inspect_checkpoint(d, scan=False, progress=lambda *a: calls.append(a))
    assert report.problems == () and not report.scanned and calls == []
    assert report.layers[0].nbytes == gemm_nbytes(256, 64, 128, False)
    rc, text = run_main(d, scan=False)
    assert rc == 0 and "values not scanned" in text and json.loads(run_main(d, as_json=True, scan=False)[1])[
        "scanned"] is False
    assert inspect_checkpoint(d).problems[0].rule is Rule.NONFINITE_SCALE


def test_progress_once_per_layer(tmp_path, rng, capsys):
    names = [f"model.layers.{i}.mlp.up_proj" for i in (0, 1, 11)]
    d = save_checkpoint(tmp_path / "ckpt", {n: logical(rng, 256, 64, 128) for n in names}, group_size=128)
    calls = []
    inspect_checkpoint(d, progress=lambda *a: calls.append(a))
    assert calls == [(i + 1, 3, f"scanning {n}") for i, n in enumerate(names)]
    inspect_checkpoint(d, progress=True)
    assert "[awq_cupy] scanning model.layers.11.mlp.up_proj 3/3" in capsys.readouterr().err
    inspect_checkpoint(d)                              # default: small, not a terminal -> silent
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="progress"):
        inspect_checkpoint(d, progress="yes")


def test_text_summarises_many_other_tensors_and_json_is_strict(tmp_path, rng):
    qt = logical(rng, 256, 64, 128)
    S = qt.S.copy()
    S[1, 2] = 0
    packed = formats.pack(qt.Q, qt.Z, S, "gemm", 128)
    others = {f"model.layers.{i}.input_layernorm.weight": np.ones(64, np.float16) for i in range(14)}
    others.update({f"model.layers.{i}.rotary.inv_freq": np.ones(8, np.float32) for i in range(3)})
    d = write_checkpoint(tmp_path / "ckpt", {**prefixed(UP, packed), **others})
    rc, text = run_main(d)
    assert rc == 1
    f16, f32 = 14 * 64 * 2, 3 * 8 * 4
    assert (f"other tensors (17):\n  by dtype: F16 14 ({f16:,} bytes ({f16 / 1024:.1f} KiB)), "
            f"F32 3 ({f32} bytes)") in text
    assert "model.layers.0.input_layernorm.weight" in text and "model.layers.13.input_layernorm.weight" not in text
    assert "... and 12 more" in text
    data = json.loads(json.dumps(inspect_checkpoint(d).to_dict(), allow_nan=False))
    assert len(data["tensors"]) == 17
    assert data["problems"] == [{"severity": "error", "where": UP, "rule": "NONPOSITIVE_SCALE", "count": 1,
                                 "index": [1, 2], "message": data["problems"][0]["message"]}]
    assert data["ok"] is False and data["summary"]["errors"] == 1
