"""The gemm_wb prototype's launch (bench/probes/kernels/gemm_wb.cu), shared by bench/probes/wb_probe.py and bench/probes/wb_case.py."""
import cupy as cp

from awq_cupy import kernels
from awq_cupy import launch as launches
from awq_cupy import plans as planner
from awq_cupy.jit import as_i32

STAGE = 256 * 128 + 64 * 144   # shared memory per stage: the decoded weights and the x image


def variant_of(spec) -> tuple:
    """(kernel name, S, CW, MODE) of a "S,D[,MODE[,CW]]" spec given as a tuple of ints (MODE 0, CW 8 by default)."""
    S, D, MODE, CW = (tuple(spec) + (0, 8)[len(spec) - 2:])[:4]
    return f"awq_gemm_wb_kernel<__half, {S}, {D}, true, {MODE}, {CW}>", S, CW, MODE


def x_images(x, KS: int):
    """x [M, K] as the kernel's per-unit images [KS][64][72]: unit ks's 64 rows of 64 k, 8 halves of padding, zeros
    past M and K."""
    M, K = x.shape
    xin = cp.zeros((KS, 64, 72), cp.float16)
    xp = cp.zeros((M, KS * 64), cp.float16)
    xp[:, :K] = x
    xin[:, :M, :64] = xp.reshape(M, KS, 64).transpose(1, 0, 2)
    return xin


def launch(k, S: int, CW: int, x, w, y, M: int, splits: int, *, pdl: bool = True, reduce: bool = True):
    """One call of prototype kernel ``k`` on weight ``w`` with x images ``x``: split-K over ``splits`` (rounded to
    whole units per split), then the split-K reduce into ``y`` unless ``reduce`` is False."""
    Np = w.NT * 64
    NT16, KS = Np // 16, w.KS
    per = -(-KS // splits)
    splits = -(-KS // per)
    ws = (launches.workspace(splits * M * Np, w.device, cp.cuda.get_current_stream().ptr) if splits > 1
          else launches.NULL)
    k.launch((-(-NT16 // 16), splits), (32 * (CW + 8),),
             (x, w.qtiles, w.scales, w.zeros, launches.NULL, y, ws, as_i32(M), as_i32(w.N), as_i32(w.K), as_i32(NT16),
              as_i32(KS), as_i32(w.group_size), as_i32(w.NG), as_i32(Np), as_i32(per)),
             smem=S * STAGE + 1024, pdl=pdl)
    if splits > 1 and reduce:
        cols = planner.reduce_columns(M, w.N, launches.sm_count(w.device))
        rk = kernels.kernel(kernels.ReduceVariant("float16", cols))
        rk.launch((min(-(-(M * w.N // cols) // 256), 4096),), (256,),
                  (ws, launches.NULL, y, as_i32(M), as_i32(w.N), as_i32(Np), as_i32(splits), as_i32(0)),
                  pdl=pdl)
