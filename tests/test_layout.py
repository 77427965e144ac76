"""The tensor-core tile layout (awq_cupy/layout.py), checked on the CPU against the mma fragment definition."""
import numpy as np
import pytest

from awq_cupy import layout


def _fragment_values(word):
    """What the kernel's magic-number conversion extracts from one word, in its order:
    (w, w>>4, w>>8, w>>12) -> low/high halves = slots (0,4), (1,5), (2,6), (3,7)."""
    pairs = []
    for sh in (0, 4, 8, 12):
        v = word >> sh
        pairs.append((v & 0xF, (v >> 16) & 0xF))
    return pairs


@pytest.mark.parametrize("K,N", [(64, 64), (48, 72), (136, 200)])
def test_tiles_hold_mma_fragments_in_the_layout_k_order(rng, K, N):
    """Word i of lane (r, c) holds, per 8-channel half h, the pairs f = 0, 1 of mma k16 step i, which stand for
    the real k 64 ks + 32 (i >> 1) + 8 r + 4 (i & 1) + 2 f + (0, 1) (layout.py docstring)."""
    Q = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    tiles = layout.pack_tiles(Q)
    Kp, Np = layout.padded_sizes(K, N)
    assert tiles.shape == (Np // 16, Kp // 64, 32, 4) and tiles.dtype == np.uint32
    Qp = np.zeros((Kp, Np), np.uint8)
    Qp[:K, :N] = Q
    checked = 0
    for t in range(Np // 16):
        for ks in range(Kp // 64):
            for lane in range(32):
                r, c = lane % 4, lane // 4
                for i in range(4):
                    (b0a, b0b), (b1a, b1b), (b2a, b2b), (b3a, b3b) = _fragment_values(int(tiles[t, ks, lane, i]))
                    k0 = 64 * ks + 32 * (i // 2) + 8 * r + 4 * (i % 2)
                    for h, (lo, hi) in enumerate((((b0a, b0b), (b1a, b1b)), ((b2a, b2b), (b3a, b3b)))):
                        n = 16 * t + 8 * h + c                     # 8-channel half h of the block, column c
                        assert (lo[0], lo[1]) == (Qp[k0, n], Qp[k0 + 1, n])
                        assert (hi[0], hi[1]) == (Qp[k0 + 2, n], Qp[k0 + 3, n])
                        checked += 1
    assert checked == (Np // 16) * (Kp // 64) * 32 * 4 * 2


def test_k_order_keeps_halves_and_gives_each_lane_contiguous_x():
    """k_of_kappa permutes each 32-k half onto itself (a half never straddles a group of 32), and the x^T values
    of lane r in a half (mma k = 16 i2 + 8 f + 2 r + e for i2, f, e in {0, 1}, in the order of its b0, b1 words of
    steps 2h, 2h + 1) are the consecutive k 32 h + 8 r .. 32 h + 8 r + 7: the GEMV's one 16-byte load."""
    kappa = np.arange(64)
    k = layout.k_of_kappa(kappa)
    assert sorted(k[:32]) == list(range(32)) and sorted(k[32:]) == list(range(32, 64))
    for h in range(2):
        for r in range(4):
            got = [int(layout.k_of_kappa(32 * h + 16 * i2 + 8 * f + 2 * r + e))
                   for i2 in range(2) for f in range(2) for e in range(2)]
            assert got == list(range(32 * h + 8 * r, 32 * h + 8 * r + 8))


@pytest.mark.parametrize("K,N", [(64, 64), (24, 8), (4096, 1000), (11008, 128)])
def test_pack_unpack_tiles_round_trip(rng, K, N):
    Q = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    tiles = layout.pack_tiles(Q)
    np.testing.assert_array_equal(layout.unpack_tiles(tiles, K, N), Q)
    # padding holds code 0
    full = layout.unpack_tiles(tiles, *layout.padded_sizes(K, N))
    assert not full[K:].any() and not full[:, N:].any()


def test_column_permutation(rng):
    A = rng.standard_normal((3, 200)).astype(np.float16)
    P = layout.permute_columns(A, 256)
    assert P.shape == (3, 256)
    for t in range(16):
        for c in range(8):
            for h in range(2):
                n = 16 * t + c + 8 * h              # lane c's fragment columns of block t
                expect = A[:, n] if n < 200 else 0
                np.testing.assert_array_equal(P[:, 16 * t + 2 * c + h], expect)
    np.testing.assert_array_equal(layout.unpermute_columns(P, 200), A)


def test_magic_zero_bits_are_exact():
    import ml_dtypes

    Z = np.arange(16, dtype=np.uint8)
    expect = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(layout.zero_bits(Z, "float16").view(np.float16).astype(np.float32), 1024 + expect)
    bf = layout.zero_bits(Z, "bfloat16").view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(bf, 128 + expect)


def test_float_bits_bf16_matches_ml_dtypes(rng):
    import ml_dtypes

    x = (rng.standard_normal(10000) * 10.0 ** rng.integers(-8, 8, 10000)).astype(np.float32)
    ours = layout.float_bits(x, "bfloat16")
    np.testing.assert_array_equal(ours, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def _halves(u32):
    """Two fp16 values of a u32 word (low, high)."""
    return np.array([u32 & 0xFFFF, u32 >> 16], dtype=np.uint16).view(np.float16)


def test_gemv_fp16_decode_is_exact(rng):
    """kernels_cu/common.cuh WeightDecoder<__half>: for every code q and zero z, the in-place conversion of the
    high nibbles (1024 + 16 q), times 1/16, plus 960 - (1024 + z), is exactly q - z in fp16; the low nibbles'
    (1024 + q) - (1024 + z) likewise. Checked on random layout words against the fragment definition."""
    Q = rng.integers(0, 16, size=(64, 16), dtype=np.uint8)
    words = layout.pack_tiles(Q)[0, 0]                    # block 0, k 0..63: [32 lanes, 4 steps]
    Z = rng.integers(0, 16, size=16, dtype=np.uint8)
    zbits = layout.zero_bits(Z, "float16")                # 1024 + z as fp16 bits
    sixteenth, k960 = np.float16(0.0625), np.float16(960.0)
    for lane in range(32):
        r, c = lane % 4, lane // 4
        zlo, zhi = zbits[c].view(np.float16), zbits[c + 8].view(np.float16)
        for step in range(4):
            w = int(words[lane, step])
            w8 = w >> 8
            a0 = _halves((w & 0x000F000F) | 0x64006400) - zlo
            a1 = _halves((w8 & 0x000F000F) | 0x64006400) - zhi
            a2 = _halves((w & 0x00F000F0) | 0x64006400) * sixteenth + (k960 - zlo)
            a3 = _halves((w8 & 0x00F000F0) | 0x64006400) * sixteenth + (k960 - zhi)
            k = 32 * (step // 2) + 8 * r + 4 * (step % 2)
            for got, kk, ch in ((a0, k, c), (a1, k, c + 8), (a2, k + 2, c), (a3, k + 2, c + 8)):
                want = Q[kk:kk + 2, ch].astype(np.int32) - int(Z[ch])
                np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_gemv_operands_multiply_to_x_at_q(rng):
    """The k order end to end, on the CPU: per 16-column block, 64-k unit and k16 step, build the mma.m16n8k16
    operands the way the GEMV does (A from the layout words, decoded as WeightDecoder does; B from each lane's two
    16-byte x loads per unit, kernels_cu/gemv_tc.cu load_x), multiply them as the PTX fragment definition says,
    and compare the sum with x @ Q (small integers, so exact)."""
    K, N, M = 128, 32, 8
    Q = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    x = rng.integers(-3, 4, size=(M, K)).astype(np.int64)
    tiles = layout.pack_tiles(Q)
    yT = np.zeros((N, M), np.int64)
    for t in range(N // 16):
        for ks in range(K // 64):
            # lane (g, t4)'s x words: st.xb[4 h + q] = word q of x[g, 64 ks + 32 h + 8 t4 .. + 7]
            xb = np.zeros((32, 8, 2), np.int64)           # lane, word, element
            for lane in range(32):
                g, t4 = lane // 4, lane % 4
                for h in range(2):
                    k = 64 * ks + 32 * h + 8 * t4
                    xb[lane, 4 * h:4 * h + 4] = x[g, k:k + 8].reshape(4, 2)
            for step in range(4):
                A = np.full((16, 16), -1, np.int64)       # channel row, mma k column
                B = np.full((16, 8), -1, np.int64)        # mma k row, token column
                for lane in range(32):
                    g, t4 = lane // 4, lane % 4
                    (a0, a1), (a2, a3), (a4, a5), (a6, a7) = _fragment_values(int(tiles[t, ks, lane, step]))
                    # a[0] = w & 0x000F000F, a[1] = (w >> 8) & .., a[2] = w & 0x00F000F0, a[3] = (w >> 8) & ..F0
                    A[g, 2 * t4:2 * t4 + 2] = (a0, a1)
                    A[g + 8, 2 * t4:2 * t4 + 2] = (a4, a5)
                    A[g, 2 * t4 + 8:2 * t4 + 10] = (a2, a3)
                    A[g + 8, 2 * t4 + 8:2 * t4 + 10] = (a6, a7)
                    B[2 * t4:2 * t4 + 2, g] = xb[lane, 2 * step]
                    B[2 * t4 + 8:2 * t4 + 10, g] = xb[lane, 2 * step + 1]
                assert (A >= 0).all() and not (B == -1).all(axis=0).any()
                yT[16 * t:16 * t + 16] += A @ B
    np.testing.assert_array_equal(yT, (x @ Q.astype(np.int64)).T)


def _natural_half(w0, w1, lane):
    """numpy model of kernels_cu/gemm_wg.cu awq_wg::natural_half on a quad's words (arrays over lanes), with the
    kernel's shuffles as gathers from lane ^ 2 and lane ^ 1."""
    b = (lane & 2) != 0
    send = np.where(b, w0, w1)
    recv = send[lane ^ 2]
    a0, a1 = np.where(b, recv, w0), np.where(b, w1, recv)
    c = (lane & 1).astype(np.uint32)
    s0, s1 = np.uint32(4) - 4 * c, 4 * c
    lo = np.uint32(0x0F0F0F0F)
    keep = np.where(c == 1, ~lo, lo).astype(np.uint32)
    pack = ((a0 >> s0) & lo) | ((a1 << s1) & ~lo)
    r = pack[lane ^ 1]
    return (a0 & keep) | ((r << s0) & ~keep), (a1 & keep) | ((r >> s1) & ~keep)


def test_natural_k_reorder_gives_each_step_its_natural_k():
    """The tensor-map GEMM reads x tiles in natural k order, so each warp reorders its weight words first
    (awq_wg::natural_k: one word exchanged with lane ^ 2, packed nibbles with lane ^ 1, per 32-k half). Modelled
    in numpy on random codes: afterwards word t of lane (c, r) holds, in nibble slot REV[4 h + 2 f + e], the code
    of channel c + 8 h at k = 16 t + 2 r + 8 f + e, the operand of wgmma k16 step t against x's own k order."""
    rng = np.random.default_rng(5)
    Q = rng.integers(0, 16, size=(128, 64), dtype=np.uint8)   # whole 64 x 64 tiles: no padding
    qt = layout.pack_tiles(Q)                                  # [NT16, KS, 32, 4]
    lane = np.arange(32)
    w = qt.copy()
    for t16 in range(qt.shape[0]):
        for ks in range(qt.shape[1]):
            for h in range(2):
                w[t16, ks, :, 2 * h], w[t16, ks, :, 2 * h + 1] = _natural_half(qt[t16, ks, :, 2 * h],
                                                                            qt[t16, ks, :, 2 * h + 1], lane)
    for t16 in range(qt.shape[0]):
        for ks in range(qt.shape[1]):
            for l in range(32):
                c, r = l // 4, l % 4
                for t in range(4):
                    for v in range(8):
                        hh, f, e = v >> 2, (v >> 1) & 1, v & 1
                        code = (int(w[t16, ks, l, t]) >> (4 * int(layout.REV[v]))) & 0xF
                        want = Q[64 * ks + 16 * t + 2 * r + 8 * f + e, 16 * t16 + c + 8 * hh]
                        assert code == want, (t16, ks, l, t, v)
    assert not np.array_equal(w, qt)   # the layout's own order differs: the reorder is not the identity
