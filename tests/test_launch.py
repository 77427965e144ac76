"""The host path of matmul: launch plans made once per call shape and cached on the weight, settings read once,
the bound call and the capture helper. CPU tests first (no device is touched), then GPU tests (marker ``gpu``)."""
from __future__ import annotations

import dataclasses
import gzip
import json
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import awq_cupy
from awq_cupy import dispatch, jit, kernels, launch, ops, plans, settings

HERE = Path(__file__).resolve().parent

# The sweep and the fakes the recording was made with: the script of commit 8c7ed94, which ran against
# that tree's private launch functions (``git show 8c7ed94:bench/record_plans.py``).
REC_SHAPES = ((4096, 6144, 128), (4096, 4096, 128), (4096, 28672, 128), (14336, 4096, 128), (8192, 10240, 128),
              (8192, 57344, 128), (28672, 8192, 128), (1408, 64, 128), (4096, 4096, 32), (2048, 1104, -1),
              (512, 384, 64))
REC_MS = (1, 2, 5, 8, 9, 12, 15, 16, 17, 20, 24, 25, 31, 32, 33, 48, 64, 100, 128, 200, 256, 512, 767, 768, 1024,
          4096)
REC_ARCHS = (("90", 132), ("80", 108))
REC_DTYPES = ("float16", "bfloat16")


def _rec_label(a, names):
    if isinstance(a, launch.TensorMap):
        return f"tensor_map:{a.rows}x{a.cols}"
    if isinstance(a, np.generic):
        return f"{type(a).__name__}:{int(a) if isinstance(a, np.integer) else float(a)}"
    return names.get(id(a), "ptr")


def _rec_weight(K, N, G):
    from awq_cupy.formats import resolve_group_size
    from awq_cupy.layout import padded_sizes

    G = resolve_group_size(G, K)
    Kp, Np = padded_sizes(K, N)

    def arr(name):
        return types.SimpleNamespace(name=name, data=types.SimpleNamespace(ptr=0))

    return types.SimpleNamespace(K=K, N=N, group_size=G, NG=K // G, KS=Kp // 64, NT=Np // 64, device=0,
                                 qtiles=arr("qtiles"), scales=arr("scales"), zeros=arr("zeros"))


class _RecKernel:
    """Stands in for a compiled kernel; the CTAs per SM it reports are a deterministic function of the variant and
    its shared memory."""

    def __init__(self, family, variant, log):
        self.family, self.name, self.log = family, variant, log

    def resident_blocks(self, threads, smem):
        return 1 if smem > 100 * 1024 or "16, 1, 4" in self.name or "32, 1, 4" in self.name else 2


# ----------------------------------------------------------------------------------------------------------------
# CPU: the planners and the launch layer make exactly the launches of the uncached implementation
# ----------------------------------------------------------------------------------------------------------------
class _FakeLaunch:
    """Stands in for launch.Launch: records the launch and keeps labelled parameter slots."""

    def __init__(self, kernel, grid, block, args, *, smem=0, pdl=False, stream=0):
        self.rec = dict(family=kernel.family, variant=kernel.name, grid=list(grid), block=list(block),
                        smem=int(smem), pdl=bool(pdl))
        self.slots = [_rec_label(a, _FakeLaunch.names) for a in args]
        self.maps = {i: a for i, a in enumerate(args) if isinstance(a, launch.TensorMap)}
        self.stream = stream

    def fire(self):
        pass


def _replay_case(arch, sms, K, N, G, dtype, M, bi, workspaces):
    w = _rec_weight(K, N, G)
    _FakeLaunch.names = {id(w.qtiles): "qtiles", id(w.scales): "scales", id(w.zeros): "zeros",
                         **{id(v): f"ws:{k}" for k, v in workspaces.items()}}
    path = plans.choose_path(M, K, N, w.group_size, dtype, arch, sms, batch_invariant=bi)
    if path is plans.Path.CUBLAS:
        return dict(path="cublas", launches=[]), None
    if path is plans.Path.GEMV:
        pc = launch.prepare_gemv(w, M, dtype, arch, sms, stream=7, capturing=False)
    else:
        pc = launch.prepare_gemm(w, M, dtype, arch, sms, stream=7, batch_invariant=bi)
    assert pc.path is path and all(lc.stream == 7 for lc in pc.launches)
    pc.run("x", "y", 0)                 # patches the labelled slots where the call's pointers go
    for lc in pc.launches:              # a tensor map is labelled by its sizes and what it was pointed at
        for i, m in lc.maps.items():
            lc.slots[i] += f"@{m.ptr}"
    Np = w.NT * 64
    for lc in pc.launches:   # arguments added after the record: the GEMMs' column base and workspace row, the
        if lc.rec["variant"].startswith(("awq_gemm_sw_kernel", "awq_gemm_wg_kernel", "awq_gemm_wg_tma_kernel")):
            tail = lc.slots[-1:] if lc.maps else []      # (the tensor map, checked by _without_tile_pass)
            assert lc.slots[-2 - len(tail):len(lc.slots) - len(tail)] == ["int32:0", f"int32:{Np}"], lc.slots
            del lc.slots[-2 - len(tail):len(lc.slots) - len(tail)]
        elif lc.rec["variant"].startswith("awq_splitk_reduce_kernel"):
            assert lc.slots[-1] == "int32:0", lc.slots
            del lc.slots[-1]
    got = dict(path=path.value, launches=[dict(lc.rec, args=lc.slots) for lc in pc.launches])
    variant = pc.plan.variant(dtype) if path is plans.Path.GEMM and pc.plan.wgmma else None
    return got, (variant if variant is not None and (variant.producers or variant.tma) else None)


def _without_tile_pass(case: dict, variant, M: int, K: int) -> dict:
    """A recorded wgmma GEMM case as it is launched where the kernel takes x without the x tile pass (``variant``,
    a kernels.WgmmaVariant with producers or a tensor map): no x tile pass, and that variant with, for producers, x
    itself as its first argument and the producer warps in its block, for a tensor map, a null first argument and
    the map of x [M, K] last; everything else as recorded."""
    launches = []
    for lc in case["launches"]:
        if lc["variant"].startswith("awq_tile_x_kernel"):
            continue
        if lc["variant"].startswith("awq_gemm_wg_kernel"):
            assert lc["args"][0] == "ws:x_tiles", lc
            assert lc["variant"] == dataclasses.replace(variant, producers=False, tma=False).expr, (lc, variant)
            args = (["x"] + lc["args"][1:] if variant.producers
                    else ["uint64:0"] + lc["args"][1:] + [f"tensor_map:{M}x{K}@x"])
            lc = dict(lc, variant=variant.expr, block=[variant.threads], args=args)
        launches.append(lc)
    assert len(launches) == len(case["launches"]) - 1, case
    return dict(case, launches=launches)


def _fake_launch_layer(monkeypatch):
    """The recording's fakes: recorded kernels (_RecKernel's CTAs per SM), labelled launches, fixed workspaces
    (returned), the H200's arch and SM count; the built-in dispatch table."""
    log: list = []
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", "builtin")
    settings.reload()
    monkeypatch.setattr(kernels, "kernel", lambda v, dev=None: _RecKernel(v.family, v.expr, log))
    monkeypatch.setattr(kernels, "get_kernel", lambda fam, v, dev=None: _RecKernel(fam.name, jit.variant_expr(v), log))
    monkeypatch.setattr(launch, "Launch", _FakeLaunch)
    monkeypatch.setattr(launch, "_gemv_shape_kernels", {})
    workspaces = {what: types.SimpleNamespace(data=types.SimpleNamespace(ptr=0)) for what in ("partials", "x_tiles")}
    monkeypatch.setattr(launch, "workspace", lambda n, dev, stream, what="partials": workspaces[what])
    _FakeLaunch.names = {**{id(v): f"ws:{k}" for k, v in workspaces.items()}}
    monkeypatch.setattr(jit, "arch_of_device", lambda dev: jit.ARCHS["90"])
    monkeypatch.setattr(launch, "sm_count", lambda dev: 132)
    return workspaces


@pytest.mark.parametrize("x_producers,x_tma", [(False, False), (True, False), (False, True)])
def test_launches_equal_the_uncached_implementations(monkeypatch, x_producers, x_tma):
    """Over 2288 cases (11 layer shapes with group sizes 128, 64, 32 and one group; M = 1 to 4096 across every
    dispatch boundary; fp16 and bf16; batch-invariant or not; sm_90 and sm_80) the path, and every launch's kernel
    (family, including the shape-compiled GEMVs), grid, block, shared memory, PDL attribute and arguments in
    order, equal what the ops.py of 8c7ed94 launched (recorded by the script
    ``git show 8c7ed94:bench/record_plans.py``, with the same fake kernels), but for the wgmma variants that copy x
    themselves or read it through a tensor map, which launch without the x tile pass (``_without_tile_pass``): with
    plans.X_PRODUCERS and plans.X_TMA off (neither planned), producers on (planned for every 128- and 256-token tile
    at the default PEND) and tensor maps on (planned for those tiles where plans.x_by_tensor_map says so)."""
    recorded = json.load(gzip.open(HERE / "data" / "launch_plans_8c7ed94.json.gz"))["cases"]
    monkeypatch.delenv("AWQ_CUPY_GEMV_SHAPES", raising=False)
    monkeypatch.delenv("AWQ_CUPY_PDL", raising=False)
    monkeypatch.delenv("AWQ_CUPY_WGMMA", raising=False)
    monkeypatch.setattr(plans, "_TAIL_GAIN", 0.0)   # the record predates tail launches (tests/test_dispatch.py)
    monkeypatch.setattr(plans, "_KSPLIT_FOUR_MIN_NB", 10**9)   # and two K streams in place of four splits
    monkeypatch.setattr(plans, "_KSPLIT_TMA", False)   # or of long two-way splits where x goes through a tensor map
    monkeypatch.setattr(plans, "X_PRODUCERS", x_producers)
    monkeypatch.setattr(plans, "X_TMA", x_tma)
    monkeypatch.setattr(plans, "_TMA_UNIT_SCALE", 1.0)   # and the cost model's tensor-map unit time (the paths)
    # and the sm_90 row's fused unit time when the record was made (the paths at M >= 768)
    monkeypatch.setitem(dispatch.TABLE, "90", dataclasses.replace(dispatch.TABLE["90"], fused_unit_us=0.78))
    monkeypatch.setattr(launch.TensorMap, "point", lambda m, ptr: setattr(m, "ptr", ptr))   # x is a label here
    workspaces = _fake_launch_layer(monkeypatch)     # (its settings.reload() reads the environment above)
    seen = producers = 0
    for arch_key, sms in REC_ARCHS:
        arch = jit.ARCHS[arch_key]
        for K, N, G in REC_SHAPES:
            for dtype in REC_DTYPES:
                if dtype == "bfloat16" and not arch.mma_k16:
                    continue
                for M in REC_MS:
                    for bi in (False, True):
                        key = f"{arch_key}/{K}x{N}/g{G}/{dtype}/M={M}/bi={int(bi)}"
                        got, producer_variant = _replay_case(arch, sms, K, N, G, dtype, M, bi, workspaces)
                        want = recorded[key]
                        if producer_variant is not None:
                            want = _without_tile_pass(want, producer_variant, M, K)
                            producers += 1
                        assert got == want, key
                        seen += 1
    assert seen == len(recorded) == 2288
    assert (producers > 0) == (x_producers or x_tma)   # those variants' cases were compared where planned


def test_prepared_call_hands_the_driver_its_config_and_patched_parameters(monkeypatch):
    """driver.Launch and launch.PreparedCall on the CPU, with cuLaunchKernelEx replaced by a reader of what it is
    given: the config struct (grid, block, shared memory, stream, the PDL attribute) and the parameter array, whose
    slots hold the prebuilt arguments with x, the output and the bias written in per call; a refused launch raises
    RuntimeError naming the kernel."""
    import ctypes

    from awq_cupy import driver

    seen = []

    def fake_launch(cfg, func, params, extra):
        c = driver.LaunchConfig.from_address(cfg)
        p = (ctypes.c_void_p * 4).from_address(params)
        attr = c.attrs[0] if c.numAttrs else None
        seen.append(dict(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=(c.blockDimX, c.blockDimY, c.blockDimZ),
                         smem=c.sharedMemBytes, stream=c.hStream, attrs=c.numAttrs, func=func,
                         attr=(attr.id, attr.value[0]) if attr else None,
                         args=[ctypes.c_uint64.from_address(p[i]).value for i in range(4)]))
        return 0

    monkeypatch.setattr(driver, "cuda_driver", lambda: None)
    monkeypatch.setattr(driver, "_launch_fn", fake_launch)
    smem_set = []
    k = types.SimpleNamespace(name="awq_probe", func_ptr=0x1234, ensure_dynamic_smem=smem_set.append)
    one = driver.Launch(k, (3, 2), (64,), (launch.NULL, np.int32(-2), launch.NULL, launch.NULL), smem=70000,
                        pdl=True, stream=0x77)
    assert smem_set == [70000]
    pc = launch.PreparedCall(plans.Path.GEMV, None, (one,), x_slots=((0, 0),), y_slots=((0, 2),), b_slots=((0, 3),))
    pc.run(0xA000, 0xB000)
    pc.run(0xA100, 0xB100, 0xC100)
    assert [s["args"] for s in seen] == [[0xA000, 2**64 - 2, 0xB000, 0], [0xA100, 2**64 - 2, 0xB100, 0xC100]]
    assert seen[0]["grid"] == (3, 2, 1) and seen[0]["block"] == (64, 1, 1) and seen[0]["smem"] == 70000
    assert seen[0]["stream"] == 0x77 and seen[0]["func"] == 0x1234 and seen[0]["attrs"] == 1
    assert seen[0]["attr"] == (driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    # several launches: each gets its own slots patched, in order; no PDL: no attribute
    seen.clear()
    two = driver.Launch(k, (1,), (32,), (launch.NULL,) * 4, stream=0x77)
    pc = launch.PreparedCall(plans.Path.GEMM, None, (one, two), x_slots=((0, 0),), y_slots=((0, 2), (1, 1)),
                             b_slots=((1, 3),))
    pc.run(0xA200, 0xB200, 0xC200)
    assert [s["args"] for s in seen] == [[0xA200, 2**64 - 2, 0xB200, 0xC100], [0, 0xB200, 0, 0xC200]]
    assert seen[1]["attrs"] == 0
    monkeypatch.setattr(driver, "_launch_fn", lambda *a: 1)
    monkeypatch.setattr(driver, "_libcuda", types.SimpleNamespace(cuGetErrorName=lambda err, ref: 0))
    with pytest.raises(RuntimeError, match="awq_probe: CUresult 1"):
        pc.run(1, 2)
    with pytest.raises(TypeError, match="numpy scalar"):
        driver.Launch(k, (1,), (32,), (5,))


def test_tensor_map_argument_is_passed_from_its_buffer_and_encoded_per_x(monkeypatch):
    """driver.TensorMap on the CPU: its sizes are checked when made (no driver call until the first point()); in a
    Launch its parameter points at the map's own 64-byte aligned 128 bytes; a PreparedCall encodes it for x (plus
    the part's row offset) on each run, once per new address, and refuses a misaligned one; encoding errors name the
    map and the driver call."""
    import ctypes

    from awq_cupy import driver

    with pytest.raises(ValueError, match="1..2"):
        driver.TensorMap(0, 64, 128, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        driver.TensorMap(10, 4100, 128, 64)
    with pytest.raises(ValueError, match="64 columns"):
        driver.TensorMap(10, 4096, 128, 32)
    with pytest.raises(ValueError, match="1..256 rows"):
        driver.TensorMap(10, 4096, 512, 64)
    m = driver.TensorMap(300, 4096, 256, 64)
    assert m.address % 64 == 0 and m.ptr is None
    encoded = []
    m._call = lambda ptr: encoded.append(ptr) or 0

    seen = []

    def fake_launch(cfg, func, params, extra):
        p = (ctypes.c_void_p * 3).from_address(params)
        seen.append((ctypes.c_uint64.from_address(p[0]).value, p[2]))
        return 0

    monkeypatch.setattr(driver, "cuda_driver", lambda: None)
    monkeypatch.setattr(driver, "_launch_fn", fake_launch)
    k = types.SimpleNamespace(name="awq_probe", func_ptr=1, ensure_dynamic_smem=lambda smem: None)
    one = driver.Launch(k, (1,), (32,), (launch.NULL, launch.NULL, m))
    assert one.maps == {2: m}
    pc = launch.PreparedCall(plans.Path.GEMM, None, (one,), x_slots=((0, 2, 4096 * 2 * 7),), y_slots=((0, 1),),
                             b_slots=((0, 0),))
    pc.run(0xA000, 0xB000)
    pc.run(0xA000, 0xB100)
    pc.run(0xC000, 0xB100)
    assert encoded == [0xA000 + 4096 * 2 * 7, 0xC000 + 4096 * 2 * 7]   # once per x, at the part's offset
    assert seen == [(0, m.address)] * 3   # the map's parameter is its own buffer; x went to no slot
    with pytest.raises(ValueError, match="16-byte aligned"):
        m.point(0xC008)
    m._call = lambda ptr: 701
    monkeypatch.setattr(driver, "_libcuda", types.SimpleNamespace(cuGetErrorName=lambda err, ref: 0))
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed for a 300 x 4096 tensor map"):
        m.point(0xD000)
    assert m.ptr is None   # a failed encode leaves the map unpointed: the next run encodes again


def test_row_split_runs_whole_tiles_then_the_rest_at_their_offsets(monkeypatch):
    """Mistral-7B gate_up at M = 300 (two 256-token tiles, the second 44 rows full): prepare_call makes the call for
    the first 256 rows and the one for the last 44, their launches in that order, the second's x and output
    pointers offset by 256 rows; the bias goes to both unshifted. M = 512 (whole tiles) and batch-invariant calls
    stay one call."""
    _fake_launch_layer(monkeypatch)
    K, N = 4096, 28672
    w = _rec_weight(K, N, 128)
    pc = launch.prepare_call(w, 300, "float16", stream=7)
    assert isinstance(pc.plan, plans.RowSplit) and pc.plan.rows == 256 and pc.path is plans.Path.GEMM
    first, second = (launch.prepare_call(w, m, "float16", stream=7) for m in (256, 44))
    assert pc.plan.first == first.plan and pc.plan.second == second.plan
    assert [lc.rec for lc in pc.launches] == [lc.rec for lc in first.launches + second.launches]
    x, y, b = 1 << 20, 1 << 30, 1 << 40
    pc.run(x, y, b)
    n = len(first.launches)
    for part, launches, rows in ((first, pc.launches[:n], 0), (second, pc.launches[n:], 256)):
        part.run("x", "y", "b")    # the labels show which slot takes which pointer
        for lc, ref in zip(launches, part.launches):
            for got, want in zip(lc.slots, ref.slots):
                expect = {"x": x + rows * K * 2, "y": y + rows * N * 2, "b": b}.get(want, want)
                assert got == expect, (rows, lc.rec["variant"], lc.slots, ref.slots)
    assert not isinstance(launch.prepare_call(w, 512, "float16", stream=7).plan, plans.RowSplit)
    assert not isinstance(launch.prepare_call(w, 300, "float16", stream=7, batch_invariant=True).plan,
                          plans.RowSplit)
    monkeypatch.setattr(plans, "_ROW_SPLIT_GAIN", 0.0)
    assert isinstance(launch.prepare_call(w, 300, "float16", stream=7).plan, plans.GemmPlan)


def test_plans_are_frozen_data():
    p = plans.plan_gemv(1, 4096, 6144, 128)
    q = plans.plan_gemm(64, 4096, 4096, 128, wgmma=True)
    for plan in (p, q):
        with pytest.raises(AttributeError):
            plan.grid = 1
    assert p == plans.plan_gemv(1, 4096, 6144, 128) and hash(p) == hash(plans.plan_gemv(1, 4096, 6144, 128))
    assert p.variant("float16").expr == "awq_gemv_tc_kernel<__half, 1, 3, true>"
    assert plans.choose_path(1, 4096, 6144, 128, "float16", jit.ARCHS["90"], 132) is plans.Path.GEMV
    assert plans.choose_path(1, 4096, 6144, 128, "float16", jit.ARCHS["90"], 132,
                             batch_invariant=True) is plans.Path.GEMM
    # dequantize + cuBLAS only outside a capture and for fp16 (a layer the cost model gives it: Mistral-7B gate_up
    # at M = 8192)
    assert plans.choose_path(8192, 4096, 28672, 128, "float16", jit.ARCHS["90"], 132) is plans.Path.CUBLAS
    assert plans.choose_path(8192, 4096, 28672, 128, "float16", jit.ARCHS["90"], 132,
                             capturing=True) is plans.Path.GEMM
    assert plans.choose_path(8192, 4096, 28672, 128, "bfloat16", jit.ARCHS["90"], 132) is plans.Path.GEMM


# ----------------------------------------------------------------------------------------------------------------
# CPU: the per-weight cache of prepared calls
# ----------------------------------------------------------------------------------------------------------------
class _Arr:
    """Enough of a device array for QuantizedWeight's constructor."""

    def __init__(self, shape):
        self.shape, self.device, self.nbytes = shape, types.SimpleNamespace(id=0), 0


def _fake_weight(K=256, N=128):
    return awq_cupy.QuantizedWeight(qtiles=_Arr((N // 16, K // 64, 32, 4)), scales=_Arr((2, N)),
                                    zeros=_Arr((2, N)), K=K, N=N, group_size=128, dtype="float16")


def test_plan_cache_hit_miss_bound_and_capture(monkeypatch):
    made = []
    capturing = {"now": False}

    def fake_prepare(w, M, kind, stream, *, batch_invariant=False, capturing=False):
        made.append((M, stream, batch_invariant, capturing))
        return types.SimpleNamespace(M=M, capturing=capturing)

    monkeypatch.setattr(launch, "prepare_call", fake_prepare)
    monkeypatch.setattr(launch, "is_capturing", lambda: capturing["now"])
    w = _fake_weight()
    a = ops._prepare(w, (1, 11, False, False))
    assert ops._prepare(w, (1, 11, False, False)) is not a       # _prepare always makes one...
    assert w._calls[(1, 11, False, False)] is not a                          # ...and the cache keeps the latest
    assert len(w._calls) == 1 and made == [(1, 11, False, False)] * 2
    # a different stream, bias or batch_invariant is a different call shape
    for key in ((1, 12, False, False), (1, 11, True, False), (1, 11, False, True), (2, 11, False, False)):
        ops._prepare(w, key)
    assert len(w._calls) == 5
    # bounded: the oldest shapes go first
    for M in range(100, 100 + ops.PLAN_CACHE_SIZE):
        ops._prepare(w, (M, 11, False, False))
    assert len(w._calls) == ops.PLAN_CACHE_SIZE and (1, 11, False, False) not in w._calls
    assert next(iter(w._calls)) == (100, 11, False, False)
    # under capture: made for the capture, never cached
    capturing["now"] = True
    n = len(w._calls)
    pc = ops._prepare(w, (3, 11, False, False))
    assert pc.capturing and len(w._calls) == n and (3, 11, False, False) not in w._calls
    capturing["now"] = False
    with launch.capture_scope({}):      # the capture helper's scope: not cached either
        assert ops._prepare(w, (3, 11, False, False)).capturing
    assert (3, 11, False, False) not in w._calls
    # settings.reload drops every weight's plans
    other = _fake_weight(512, 256)
    ops._prepare(other, (1, 11, False, False))
    settings.reload()
    assert w._calls == {} and other._calls == {}


def test_settings_are_read_once_and_reloaded_on_request(monkeypatch):
    monkeypatch.setenv("AWQ_CUPY_PDL", "1")
    settings.reload()
    arch = jit.ARCHS["90"]
    assert plans.uses_pdl(arch)
    monkeypatch.setenv("AWQ_CUPY_PDL", "0")
    assert plans.uses_pdl(arch), "the environment is read once, not per call"
    calls = []
    monkeypatch.setattr(settings, "_hooks", list(settings._hooks))
    settings.on_reload(lambda: calls.append(1))
    s = settings.reload()
    assert not s.pdl and not plans.uses_pdl(arch) and calls == [1]
    monkeypatch.setenv("AWQ_CUPY_WGMMA", "0")
    monkeypatch.setenv("AWQ_CUPY_GEMV_SHAPES", "1")
    monkeypatch.setenv("AWQ_CUPY_DISPATCH", "builtin")
    s = settings.reload()
    assert s == settings.Settings(pdl=False, wgmma=False, gemv_shapes=settings.GemvShapes.ALWAYS, dispatch="builtin")
    assert not plans.has_wgmma(arch) and plans.gemv_specializes(arch, 64, 64)
    assert settings.current() is s
    monkeypatch.setenv("AWQ_CUPY_GEMV_SHAPES", "sometimes")
    with pytest.raises(ValueError, match="AWQ_CUPY_GEMV_SHAPES='sometimes'"):
        settings.reload()
    with pytest.raises(ValueError, match="AWQ_CUPY_GEMV_SHAPES"):
        settings.current()


def test_tuned_table_reload_drops_plans(monkeypatch, tmp_path):
    """dispatch.write_table (what ``tune`` calls) reloads: the weights' cached plans are dropped with it."""
    w = _fake_weight()
    w._calls[(1, 0, False, False)] = object()
    path = tmp_path / "t.json"
    dispatch.write_table(path, {"90": dispatch.TABLE["90"]}, {})
    assert w._calls == {}


def test_bind_and_capture_reject_bad_arguments():
    w = _fake_weight()
    with pytest.raises(ValueError, match="K=256"):
        awq_cupy.bind(w, (4, 128))
    with pytest.raises(TypeError, match="an int M"):
        awq_cupy.bind(w, "4")
    with pytest.raises(ValueError, match="no rows"):
        awq_cupy.bind(w, 0)
    b = awq_cupy.bind(w, 3)
    assert b.x_shape == (3, 256) and b.out_shape == (3, 128) and b.M == 3
    assert awq_cupy.bind(w, (2, 5, 256)).M == 10
    with pytest.raises(TypeError, match="QuantizedWeight"):
        ops.BoundMatmul(object(), 1)
    with pytest.raises(TypeError, match="callable"):
        awq_cupy.capture(42)
    with pytest.raises(ValueError, match="warmup=0"):
        awq_cupy.capture(lambda: None, warmup=0)


def test_matmul_rejects_a_non_weight_before_touching_a_device():
    with pytest.raises(TypeError, match="QuantizedWeight"):
        awq_cupy.matmul(np.zeros((1, 4), np.float16), object())


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------
def _gpu():
    from awq_cupy._array import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU available (cupy.cuda.is_available() is False)")
    import cupy

    return cupy


def _weight(rng, K, N, G=128, kind="float16"):
    from gpu_util import random_layer
    from awq_cupy import formats

    Q, Z, S, G = random_layer(rng, K, N, G)
    t = formats.pack(Q, Z, S, "gemm", G)
    return awq_cupy.QuantizedWeight.from_gemm(t["qweight"], t["qzeros"], t["scales"], G, dtype=kind), (Q, Z, S, G)


def _bits(a):
    return a.view(np.uint16).get()


BOUNDARY_M = (1, 8, 9, 16, 17, 24, 32, 33, 64, 256, 767, 768, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_cached_calls_equal_first_calls_and_the_reference(rng, kind):
    """Over the dispatch boundaries (M = 1 .. 1024), with and without a bias and batch-invariant: the cached call
    (a call shape's second) gives bitwise the first call's output, on a fresh weight each time (so the first is a
    plan made afresh), a fresh output, and a plain ``out=None`` call; all are close to the float64 reference of
    the weight the path multiplies. (bench/device/same_bits.py compares against the uncached implementation itself.)"""
    cp = _gpu()
    from gpu_util import assert_matmul_close, either_weight, np_dtype, random_x

    K, N = 2048, 2112
    w, (Q, Z, S, G) = _weight(rng, K, N, 128, kind)
    bias = cp.asarray((rng.standard_normal(N) * 0.1).astype(np_dtype(kind)))
    for M in BOUNDARY_M:
        x = cp.asarray(random_x(rng, M, K, kind, scale=0.1))
        for kw in ({}, {"bias": bias}, {"batch_invariant": True}):
            fresh = awq_cupy.QuantizedWeight(qtiles=w.qtiles, scales=w.scales, zeros=w.zeros, K=K, N=N,
                                             group_size=G, dtype=kind)
            y1 = cp.full((M, N), 0x7E00, dtype=cp.uint16).view(x.dtype)
            awq_cupy.matmul(x, fresh, out=y1, **kw)
            y2 = cp.full((M, N), 0x7E00, dtype=cp.uint16).view(x.dtype)
            awq_cupy.matmul(x, fresh, out=y2, **kw)
            y3 = awq_cupy.matmul(x, fresh, **kw)
            assert len(fresh._calls) == 1
            what = f"M={M} {kind} {sorted(kw)}"
            np.testing.assert_array_equal(_bits(y1), _bits(y2), err_msg=what)
            np.testing.assert_array_equal(_bits(y1), _bits(y3), err_msg=what)
            bi = kw.get("batch_invariant", False)
            assert_matmul_close(y1.get(), x.get(), either_weight(Q, Z, S, G, kind), kind,
                                bias=bias.get() if "bias" in kw else None, what=what)


@pytest.mark.gpu
def test_cached_call_shapes_and_errors(rng):
    """1-D and 3-D x on the cached path equal the 2-D call; bad outputs are refused with the rule named."""
    cp = _gpu()
    K, N = 512, 384
    w, _ = _weight(rng, K, N)
    x = cp.asarray(rng.standard_normal((6, K)).astype(np.float16))
    y = awq_cupy.matmul(x, w)
    np.testing.assert_array_equal(_bits(awq_cupy.matmul(x.reshape(2, 3, K), w).reshape(6, N)), _bits(y))
    np.testing.assert_array_equal(_bits(awq_cupy.matmul(x[2], w)), _bits(y[2]))
    np.testing.assert_array_equal(_bits(awq_cupy.matmul(x[:, ::1].T.copy().T, w)), _bits(y))   # F-order: copied
    buf = cp.empty(6 * N + 8, cp.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        awq_cupy.matmul(x, w, out=buf[1:1 + 6 * N].reshape(6, N))
    with pytest.raises(ValueError, match="shape \\(6, 384\\)"):
        awq_cupy.matmul(x, w, out=cp.empty((6, N + 8), cp.float16))
    with pytest.raises(ValueError, match="dtype float16"):
        awq_cupy.matmul(x, w, out=cp.empty((6, N), cp.float32))
    both = cp.empty(6 * max(K, N) * 2, cp.float16)
    xo = both[:6 * K].reshape(6, K)
    xo[...] = x
    with pytest.raises(ValueError, match="overlap"):
        awq_cupy.matmul(xo, w, out=both[6 * K - 8 * 6:6 * K - 8 * 6 + 6 * N].reshape(6, N))
    with pytest.raises(ValueError, match="K=512"):
        awq_cupy.matmul(cp.empty((6, K + 64), cp.float16), w)
    with pytest.raises(TypeError, match="float32"):
        awq_cupy.matmul(x.astype(cp.float32), w)
    with pytest.raises(ValueError, match="bias has shape"):
        awq_cupy.matmul(x, w, bias=cp.empty(N + 1, cp.float16))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        awq_cupy.matmul(x.get(), w)


@pytest.mark.gpu
def test_bound_call_equals_matmul(rng):
    cp = _gpu()
    K, N = 4096, 1104
    w, _ = _weight(rng, K, N)
    bias = cp.asarray((rng.standard_normal(N) * 0.1).astype(np.float16))
    for M in (1, 16, 24, 64):
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
        f = awq_cupy.bind(w, M, bias=bias)
        y = cp.empty((M, N), cp.float16)
        assert f(x, out=y) is y
        np.testing.assert_array_equal(_bits(y), _bits(awq_cupy.matmul(x, w, bias=bias)))
        np.testing.assert_array_equal(_bits(f(x)), _bits(y))
        # another shape falls back to matmul's checks (and its errors)
        with pytest.raises(ValueError, match="K=4096"):
            f(cp.empty((M, K + 64), cp.float16))
        np.testing.assert_array_equal(_bits(f(x[:1])), _bits(awq_cupy.matmul(x[:1], w, bias=bias)))


@pytest.mark.gpu
def test_capture_helper_on_shapes_never_run(rng):
    """awq_cupy.capture on weight shapes and token counts never run before: the warm-up loads every kernel (the
    shape-compiled GEMVs included; nothing is loaded during the capture), the replay equals the eager step bitwise,
    and new inputs written into the captured arrays reach the replay."""
    cp = _gpu()
    from awq_cupy.jit import arch_of_device

    layers = [_weight(rng, 2048, 2176)[0], _weight(rng, 2176, 2048)[0], _weight(rng, 2048, 2048, 64)[0]]
    for M in (1, 16, 20, 40, 300):
        x = cp.asarray((rng.standard_normal((M, 2048)) * 0.1).astype(np.float16))
        ys = [cp.empty((M, lw.N), cp.float16) for lw in layers]

        loads = []

        def step():
            before = (len(jit._modules), len(jit._kernels))
            awq_cupy.matmul(x, layers[0], out=ys[0])
            awq_cupy.matmul(ys[0], layers[1], out=ys[1])
            y = awq_cupy.matmul(ys[1], layers[2])      # allocated inside the step: the step's pool
            loads.append((launch.is_capturing(), (len(jit._modules), len(jit._kernels)) != before))
            return y

        before = len(launch._gemv_shape_kernels)
        g = awq_cupy.capture(step)
        assert loads[-1] == (True, False), "nothing is loaded while capturing"
        if plans.gemv_specializes(arch_of_device(0), 2048, 2176) and M <= 16:
            assert len(launch._gemv_shape_kernels) > before, "the warm-up compiles the shape's GEMV"
        out = g()
        cp.cuda.get_current_stream().synchronize()
        replay = [_bits(ys[0]), _bits(ys[1]), _bits(out)]
        eager_last = step()
        eager = [_bits(ys[0]), _bits(ys[1]), _bits(eager_last)]
        for i, (a, b) in enumerate(zip(replay, eager)):
            np.testing.assert_array_equal(a, b, err_msg=f"layer {i} M={M}")
        x[...] = cp.asarray((rng.standard_normal((M, 2048)) * 0.1).astype(np.float16))
        out = g()
        again = step()
        np.testing.assert_array_equal(_bits(out), _bits(again), err_msg=f"new inputs, M={M}")
        assert g.outputs is out


@pytest.mark.gpu
def test_first_calls_from_several_threads_at_once(rng):
    """Six threads, each on its own stream, make their first calls of new weights and shapes at the same moment
    (plans, workspaces and kernels built concurrently), then keep calling: every output equals the one-thread
    result bitwise."""
    cp = _gpu()
    shapes = [(2048, 4224), (4224, 2048)]
    ws = [_weight(rng, K, N)[0] for K, N in shapes]
    cases = [(M, i % 2) for i, M in enumerate((1, 9, 16, 24, 64, 300))]
    xs = [cp.asarray((rng.standard_normal((M, shapes[j][0])) * 0.1).astype(np.float16)) for M, j in cases]
    barrier = threading.Barrier(len(cases))
    got, errors = {}, []

    def work(t):
        try:
            M, j = cases[t]
            with cp.cuda.Stream(non_blocking=True) as s:
                barrier.wait()
                outs = [awq_cupy.matmul(xs[t], ws[j]) for _ in range(20)]
                s.synchronize()
            got[t] = [_bits(o) for o in outs]
        except Exception as e:   # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(cases))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t, (M, j) in enumerate(cases):
        want = _bits(awq_cupy.matmul(xs[t], ws[j]))
        for o in got[t]:
            np.testing.assert_array_equal(o, want, err_msg=f"thread {t} M={M}")


@pytest.mark.gpu
def test_reload_replans_with_the_new_settings(rng, monkeypatch):
    cp = _gpu()
    from awq_cupy.jit import arch_of_device

    w, _ = _weight(rng, 2048, 2048)
    x = cp.asarray(rng.standard_normal((1, 2048)).astype(np.float16))
    y = _bits(awq_cupy.matmul(x, w))
    (pc,) = w._calls.values()
    pdl = plans.uses_pdl(arch_of_device(0))
    assert bool(pc.launches[0]._cfg.numAttrs) == pdl
    monkeypatch.setenv("AWQ_CUPY_PDL", "0")
    settings.reload()
    assert w._calls == {}
    np.testing.assert_array_equal(_bits(awq_cupy.matmul(x, w)), y)
    (pc,) = w._calls.values()
    assert pc.launches[0]._cfg.numAttrs == 0
