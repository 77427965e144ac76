"""Launch planning and the dispatch table, on the CPU (no device is touched)."""
import pytest

from awq_cupy import dispatch, jit, kernels
from awq_cupy.ops import plan_gemv, plan_splits, rounds_weights, uses_cublas


@pytest.mark.parametrize("NT,chunks", [(448, 64), (64, 64), (96, 64), (64, 224), (1, 1), (16, 64), (7, 3)])
@pytest.mark.parametrize("resident", [132, 264])
def test_gemv_stripes_cover_the_work_exactly_once(NT, chunks, resident):
    grid, L = plan_gemv(NT, chunks, resident, kernels.GEMV_WARPS)
    total = NT * chunks
    warps = grid * kernels.GEMV_WARPS
    assert L >= 1 and grid >= 1
    assert warps * L >= total, "some work would not be assigned"
    assert (grid - 1) * kernels.GEMV_WARPS * L < total, "a whole CTA would have nothing to do"
    assert grid <= resident, "the grid must fit the resident capacity once"


@pytest.mark.parametrize("k_stages,n_ctas,m_tiles", [(64, 112, 1), (64, 16, 1), (224, 16, 4), (1, 1, 1), (3, 2, 64)])
def test_gemm_splits_partition_k(k_stages, n_ctas, m_tiles):
    splits, per = plan_splits(k_stages, n_ctas, m_tiles)
    assert splits >= 1 and per >= 1
    assert (splits - 1) * per < k_stages <= splits * per, "every split gets work and K is covered"


def test_dispatch_table_is_consistent():
    for key, d in dispatch.TABLE.items():
        assert 1 <= d.gemv_max_m <= 8 * max(kernels.GEMV_TOKEN_BLOCKS), key
        assert d.cublas_min_m > d.gemv_max_m, key
    assert dispatch.for_arch("does-not-exist") == dispatch.TABLE["default"]
    d = dispatch.for_arch("90")
    assert not rounds_weights(d.gemv_max_m) and rounds_weights(d.gemv_max_m + 1)
    assert rounds_weights(1, batch_invariant=True)
    assert uses_cublas(d.cublas_min_m, "float16") and not uses_cublas(d.cublas_min_m - 1, "float16")
    assert not uses_cublas(10**6, "bfloat16") and not uses_cublas(10**6, "float16", batch_invariant=True)


@pytest.mark.parametrize("arch", list(jit.ARCHS))
def test_gemv_ring_fits_the_arch(arch):
    a = jit.ARCHS[arch]
    for nb in kernels.GEMV_TOKEN_BLOCKS:
        for ch in kernels.GEMV_CHUNKS:
            depth = kernels.gemv_depth(a, nb, ch)
            assert depth >= 2, "the ring needs a slot being filled and one being read"
            assert kernels.gemv_smem_bytes(nb, ch, depth) <= a.smem_optin
