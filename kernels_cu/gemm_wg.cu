// gemm_wg.cu: W4A16 matmul on Hopper warpgroup MMA (sm_90a), y^T[N, M] = W^T @ x^T, fp32 accumulation.
// For M from a few dozen rows up (the dispatch table's wgmma_min_m); the sm_90a counterpart of awq_gemm_sw_kernel
// (gemm_tc.cu), with the same operands, work split and weight rounding (fp32 sums may differ in the last bits).
//
// Why: mma.sync stays below ~45% of the tensor pipe here (docs/design.md §wgmma GEMM (gemm_wg)): with the
// accumulators of a useful tile in registers only two warps fit per scheduler, and each warp's stream of decode +
// ldmatrix + mma stalls on its own dependencies. wgmma runs asynchronously: a warp issues one instruction per 16
// channels x 8 NB tokens x 16 k and decodes the next weight fragments while the tensor cores work.
// - A (the weights) comes from registers: each warp's 16 channels of a 16-column block, decoded from the tile
//   layout exactly as in the GEMV and the mma.sync GEMM (the word of lane (g, t) is its mma A fragment), times the
//   scales: T((q - z) * s) with one rounding. A warpgroup's 4 warps make the 64 rows of one wgmma.
// - B (x^T) comes from shared memory: per 64-k unit BM = 8 NB token rows of 128 bytes in the layout's mma k order,
//   16-byte chunks XOR-swizzled by row (the 128-byte swizzle of the wgmma descriptor, slots 1024-byte aligned);
//   k16 step t starts 32 t bytes in.
// Pipeline: x is first laid out by awq_tile_x_kernel as the exact shared-memory image of each (token tile, 64-k
// unit): BM rows of 128 B, swizzled, zero past M and K. One thread requests unit u + SLOTS - 2 with a single bulk
// copy (cp.async.bulk, completion counted in bytes on the slot's mbarrier) at the start of unit u, so up to
// SLOTS - 2 units of x are in flight without registers (x staged through registers, with loads issued one unit
// ahead, leaves the tensor pipe ~64% idle on long-scoreboard stalls at M = 1024). Weights, scales and zeros
// come into registers (plain loads; a cp.async ring does not overlap on the H200) in batches of B = P / 2 units,
// two batches of registers: the next batch is requested right after the first wgmma of the current batch, so the
// first use of a batch waits only for loads issued B units earlier. (ptxas counts all these loads on one
// scoreboard and waits for all of them at a first use: loading one unit ahead per unit would make the first unit of
// each unrolled round wait for the loads just issued, a full memory latency every P units.)
// Per unit every thread waits for its slot's mbarrier phase, and the CTA meets at one barrier after the unit, so
// that the slot refilled next (that of unit u - 1) is no longer read. Per k16 step a warp waits until at most
// PEND wgmma groups are pending (1 below 128 tokens, 3 from there; four fragment buffers, so the one it is about
// to overwrite is free, and at the barrier after unit u every wgmma of unit u - 1 has finished), decodes, fences
// and issues TW wgmma. Each buffer is read again (awq_wg::retire) right after the wait that retires its wgmmas,
// so that the compiler keeps it in its own registers while they run (it does not know that a wgmma still reads
// them; docs/design.md §wgmma GEMM (gemm_wg)).
// Work split: CTA = 8 warps (2 warpgroups) x TW 16-column blocks per warp x BM tokens; grid (column tiles, splits,
// token tiles); split-K partials summed by awq_splitk_reduce_kernel (gemm_tc.cu) in split order.
// Epilogue: the tile (y in T, or the split's fp32 partials) is laid out in the free x slots and leaves in 16-byte
// chunks of whole rows (awq_wg::store_tile_staged, store_partials_staged): stored from the wgmma layout, a warp's
// store instruction touches four token rows while the tensor cores idle (docs/design.md §wgmma GEMM (gemm_wg)).
// awq_gemm_wg_tma_kernel (the 128- and 256-token shapes): the same pipeline with each unit's x box copied from
// x [M, K] itself by a tensor map, in natural k order, and the weight words reordered to match (awq_wg::natural_k).
// Variants: T x (NB, TW, P) x GA (table: awq_cupy/kernels.py GEMM_WG_SHAPES), PEND, KW, XP, XT; awq_tile_x_kernel
// per T.
#include "common.cuh"
#include "gemm_units.cuh"
#include "wgmma.cuh"

namespace awq_wg {
constexpr int WARPS = 8;              // the consumers: warps that decode weights and issue wgmmas
constexpr int THREADS = 32 * WARPS;
constexpr int SLOTS = 6;   // x slots: SLOTS - 2 units requested ahead
// x producers (template XP): variants of 128 and 256 tokens with one block per warp and PEND = 3 (one CTA per SM)
// can have PRODUCER_WARPS more warps that copy x from global memory into the slots themselves, in place of
// awq_tile_x_kernel's pass and the bulk copies. Registers move between the roles (setmaxnreg): the consumers'
// accumulators and weight batches need 208 (less spills one variant), and a producer holds PRODUCER_DEPTH batches
// of four 16-byte loads in the rest (48 registers of data). ptxas counts all those loads on one scoreboard, so
// only about one batch is in flight per memory latency, which makes these variants 2-3x slower than the pass;
// they are built and tested but not planned (docs/design.md §wgmma GEMM (gemm_wg)).
// awq_cupy.kernels.WgmmaVariant.threads is checked against cta_threads per variant.
constexpr int PRODUCER_WARPS = 4;
constexpr int CONSUMER_REGS = 208, PRODUCER_REGS = 88;
// setmaxnreg.inc takes registers only from those the CTA's own warps gave back with setmaxnreg.dec: a CTA starts
// with the launch bound's per-thread count (65536 / 384 threads, rounded down to 8 = 168), and asking the
// consumers to grow by more than the producers shrank leaves them waiting forever.
constexpr int LAUNCH_REGS = 65536 / (THREADS + 32 * PRODUCER_WARPS) / 8 * 8;
static_assert(THREADS * (CONSUMER_REGS - LAUNCH_REGS) <= 32 * PRODUCER_WARPS * (LAUNCH_REGS - PRODUCER_REGS),
              "the consumers' extra registers come from the producers'");
#ifdef AWQ_PROBE_PRODUCER_DEPTH   // timing probes (bench/sweeps/ab_gemm.py AB_DEFINES)
constexpr int PRODUCER_DEPTH = AWQ_PROBE_PRODUCER_DEPTH;
#else
constexpr int PRODUCER_DEPTH = 3;
#endif
template <int NB, int TW, int PEND> constexpr bool producers_fit() { return NB >= 16 && TW == 1 && PEND == 3; }
template <bool XP> constexpr int cta_threads() { return THREADS + (XP ? 32 * PRODUCER_WARPS : 0); }
// x slot of NB token blocks: 8 NB rows of 128 B (one 64-k unit); the dynamic shared memory holds SLOTS of them
// plus 1 KB, so that the slots can start on the 1024-byte boundary the 128-byte swizzle needs. The launch takes
// awq_cupy.kernels.WgmmaVariant.smem_bytes, checked against smem_bytes by a static_assert per variant.
template <int NB> constexpr int slot_bytes() { return 8 * NB * 128; }
template <int NB> constexpr int smem_bytes() { return SLOTS * slot_bytes<NB>() + 1024; }
// (fence / commit / wait and the shared-memory descriptor: wgmma.cuh)

// Keep the compiler from moving accesses of an accumulator across the asynchronous MMAs.
template <int R> AWQ_DEVICE void pin(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A wgmma reads its A registers until a wait retires it, which the compiler does not know: after the wgmma's asm
// statement it may give those registers to other values (as it did, merging a pair of buffers, in a weights-as-B
// prototype). Reading a fragment buffer here, right after the wait that retires its wgmmas, keeps its
// values live for the whole flight, so their registers cannot be given to other values meanwhile (ptxas could
// still move or spill them; tests/test_kernels.py reads the SASS for such writes).
template <int TW> AWQ_DEVICE void retire(u32 (&a)[TW][4]) {
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j]));
}

// Four 8 x 8 matrices of 16-bit values stored transposed (stmatrix .trans, sm_90): register r of a thread holds
// row lane / 4, columns 2 (lane % 4) and + 1 of matrix r (the mma C fragment layout, low half first); lane l gives
// the address of row l % 8 of matrix l / 8, where column c of the fragment is written as that row's 16 bytes.
AWQ_DEVICE void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// Four 8 x 8 matrices of 16-bit values, not transposed: register r of a thread holds row lane / 4, word lane % 4
// of matrix r; lane l gives the address of row l % 8 of matrix l / 8 (16 bytes).
AWQ_DEVICE void stmatrix_x4(u32 addr, const uint4& r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r.x), "r"(r.y),
               "r"(r.z), "r"(r.w)
               : "memory");
}
AWQ_DEVICE void sts32(u32 addr, float v) { asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory"); }

// The epilogue through shared memory. Stored straight from the wgmma layout, each store instruction of a warp
// touches four token rows (2 or 4 bytes a lane, 128 instructions per thread at 256 tokens), all while the tensor
// cores idle; staged, the tile leaves as whole 16-byte chunks, a warp's stores covering contiguous rows.
// The stage: the tile's BM token rows of CPR 16-byte chunks at the 1024-byte aligned shared address `stage` (free
// x slots), chunk c of row r at c ^ (r % 8), so that the rows a warp writes at once and the chunks it reads fall in
// distinct banks. A warp's TW blocks are the tile's local blocks lb0.. (channels 16 lb.. of the tile). NT threads
// (st = 0..NT-1, named barrier BAR) stage and then copy the tile; the caller has made sure that no wgmma still
// reads the slots and, for two K streams, that the hand-off area below `stage` is no longer read.
template <int CPR> AWQ_DEVICE u32 stage_chunk(u32 stage, int row, int c) {
  return stage + row * (16 * CPR) + ((c ^ (row & 7)) << 4);
}

// Copy phase: row r < rows of the stage to dst + r row_bytes, its chunks c < chunks (the tile's columns inside the
// output), one 16-byte load and store per chunk; every thread keeps one chunk column (NT % CPR == 0).
template <int BM, int CPR, int NT, int BAR>
AWQ_DEVICE void copy_staged(u32 stage, unsigned char* __restrict__ dst, long long row_bytes, int rows, int chunks,
                            int st) {
  static_assert(CPR >= 8 && (CPR & (CPR - 1)) == 0 && NT % CPR == 0 && (BM * CPR) % NT == 0, "whole rounds");
  asm volatile("bar.sync %0, %1;\n" ::"n"(BAR), "n"(NT) : "memory");   // the NT threads only (no producers)
  const int c = st & (CPR - 1);
  if (c >= chunks) return;
#pragma unroll
  for (int rr = 0; rr < BM * CPR / NT; ++rr) {
    const int row = (st + NT * rr) / CPR;
    const uint4 v = lds128(stage_chunk<CPR>(stage, row, c));
    if (row < rows) *reinterpret_cast<uint4*>(dst + row * row_bytes + 16 * c) = v;
  }
}

// y directly: CH channels of T per row (8 a chunk), rounded with the bias added as store_swapped_tile does; the
// stage's 8 x 8 matrices written transposed by stmatrix, two token blocks and both channel halves at once.
template <typename T, int TW, int NB, int CH, int NT, int BAR>
AWQ_DEVICE void store_tile_staged(const float (&acc)[TW][4 * NB], const T* __restrict__ bias, T* __restrict__ y,
                                  int M, int N, int m0, int c0, int lb0, u32 stage, int st, int lane) {
  constexpr int CPR = CH / 8;
  static_assert(NB % 2 == 0, "token blocks in pairs");
  const int g8 = lane >> 2;
#pragma unroll
  for (int i = 0; i < TW; ++i) {
    const int ch = c0 + 16 * (lb0 + i) + g8;
    const float b0 = (bias != nullptr && ch < N) ? Traits<T>::to_float(bias[ch]) : 0.f;
    const float b1 = (bias != nullptr && ch + 8 < N) ? Traits<T>::to_float(bias[ch + 8]) : 0.f;
    const int chunk = 2 * (lb0 + i) + ((lane >> 3) & 1);
#pragma unroll
    for (int jp = 0; jp < NB / 2; ++jp) {
      u32 r[4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {   // matrix mi: token block 2 jp + mi / 2, channels + 8 (mi % 2)
        const int j = 2 * jp + (mi >> 1), e = 2 * (mi & 1);
        const float bv = (mi & 1) ? b1 : b0;
        r[mi] = pack2<T>(acc[i][4 * j + e] + bv, acc[i][4 * j + e + 1] + bv);
      }
      stmatrix_x4_trans(stage_chunk<CPR>(stage, 16 * jp + 8 * (lane >> 4) + (lane & 7), chunk), r);
    }
  }
  // N % 8 == 0 and y is 16-byte aligned (the host checks both)
  copy_staged<8 * NB, CPR, NT, BAR>(stage, reinterpret_cast<unsigned char*>(y + (long long)m0 * N + c0),
                                    2LL * N, M - m0, (N - c0) / 8, st);
}

// Split-K partials: CH fp32 sums per row (4 a chunk) into the split's rows of ws, ws_ld floats apart, from column
// c0 - ws_col0; a thread's values go to the stage one by one (the eight rows a store instruction touches sit in
// distinct banks through the swizzle).
template <int TW, int NB, int CH, int NT, int BAR>
AWQ_DEVICE void store_partials_staged(const float (&acc)[TW][4 * NB], float* __restrict__ ws, int M, int N, int ws_ld,
                                      int ws_col0, int m0, int c0, int lb0, u32 stage, int st, int lane) {
  constexpr int CPR = CH / 4;
  const int g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 8 * j + 2 * t4 + (e & 1), chl = 16 * (lb0 + i) + g8 + 8 * (e >> 1);
        sts32(stage_chunk<CPR>(stage, row, chl >> 2) + 4 * (chl & 3), acc[i][4 * j + e]);
      }
  float* dst = ws + ((long long)blockIdx.y * M + m0) * ws_ld + (c0 - ws_col0);
  copy_staged<8 * NB, CPR, NT, BAR>(stage, reinterpret_cast<unsigned char*>(dst), 4LL * ws_ld, M - m0,
                                    (N - c0) / 4, st);
}
// A lane's weight words (its 16 bytes of a 64-k block, in the layout's k order) rearranged within its quad into
// natural k order, for B tiles that hold x as it is in memory (the tensor-map variant): word t then feeds k16 step t
// with the A fragment of k 16 t + 2 r, + 1 (pair f = 0, low nibble of each byte) and 16 t + 2 r + 8, + 9 (f = 1,
// high nibbles), r = lane % 4. In the layout, lane r's word i, pair f holds k pair p = 16 (i >> 1) + 4 r + 2 (i & 1)
// + f (k = 2 p, 2 p + 1); natural order wants pair 8 t + 4 f + r there. Per 32-k half (words 2 h, 2 h + 1) that is a
// 4 x 4 transpose between the quad's lanes of the four pair slots (word i & 1, nibble half f): the word index
// swaps with lane bit 1 (one whole word exchanged), then the nibble half with lane bit 0 (the nibbles of both words
// that leave, packed into one word). Two shuffles and ~11 integer instructions per half.
AWQ_DEVICE void natural_half(u32& w0, u32& w1, int lane) {
  const bool b = lane & 2;
  const u32 recv = __shfl_xor_sync(0xffffffffu, b ? w0 : w1, 2);
  const u32 a0 = b ? recv : w0, a1 = b ? w1 : recv;   // word j now comes from the lane whose bit 1 is j
  const u32 c = lane & 1, s0 = 4 - 4 * c, s1 = 4 * c;
  const u32 lo = 0x0f0f0f0fu, keep = c ? ~lo : lo;    // this lane keeps nibble half c, sends the other
  const u32 pack = ((a0 >> s0) & lo) | ((a1 << s1) & ~lo);
  const u32 r = __shfl_xor_sync(0xffffffffu, pack, 1);
  w0 = (a0 & keep) | ((r << s0) & ~keep);
  w1 = (a1 & keep) | ((r >> s1) & ~keep);
}
AWQ_DEVICE uint4 natural_k(uint4 w, int lane) {
  natural_half(w.x, w.y, lane);
  natural_half(w.z, w.w, lane);
  return w;
}

// Named barrier of the consumer warps (the producers have left or never existed).
constexpr int CONSUMERS_BAR = 3;
AWQ_DEVICE void sync_consumers() { asm volatile("bar.sync %0, %1;\n" ::"n"(CONSUMERS_BAR), "n"(THREADS) : "memory"); }

// The x producer of one K stream (TEAM warps, this one team warp tw): for each of the stream's n units v, the
// BM x 64 tile of x (rows m0.., k 64 (ub + v)..) into slot v % SL as the image awq_tile_x_kernel writes (zero past
// M and K), so that results are bitwise those of the pass. A warp covers four token rows at a time (a group):
// lane l reads natural chunk l % 8 (k 32 h + 8 p.., its words j the pairs k 32 h + 8 p + 2 j) of row l / 8, and
// one stmatrix writes the group: matrix j, row 2 (l / 8) + h is logical chunk 4 h + j of that token row, whose
// word p is word j of lane (row, chunk 4 h + p). Per thread, batches of PB groups' loads in PRODUCER_DEPTH
// register sets (each batch's first store waits for every load issued before it: see PRODUCER_REGS).
// Before the first write into a slot again the producer waits until every consumer warp of the stream has
// released the unit it held (empty barrier); each thread makes its writes visible to the wgmmas' (asynchronous)
// proxy and arrives on the slot's full barrier.
template <typename T, int BM, int TEAM, int SL>
AWQ_DEVICE void produce_x(const T* __restrict__ x, int M, int K, int m0, int ub, int n, u32 slot0, u32 full0,
                          u32 empty0, int tw, int lane) {
  constexpr int GPW = BM / 4 / TEAM, PB = GPW < 4 ? GPW : 4, QB = GPW / PB;   // groups, per batch, batches
  static_assert(GPW % PB == 0 && PB % 2 == 0, "whole batches of group pairs");
  const int c = lane & 7, rr = (lane & 7) >> 1, achunk = 4 * (lane & 1) + (lane >> 3);
  const int g0 = tw * GPW;
  const long long row0 = m0 + 4 * g0 + (lane >> 3);
  // this lane's stmatrix address in group g: row 4 g + rr, chunk achunk ^ (row % 8), where g % 2 = i % 2
  const u32 sw0 = rr * 128 + ((achunk ^ rr) << 4), sw1 = rr * 128 + ((achunk ^ (4 + rr)) << 4);
  auto load = [&](int b, uint4 (&r)[PB]) {
    const int v = b / QB, q = b - v * QB;
    const int k = 64 * (ub + v) + 8 * c;   // K % 8 == 0: a chunk is inside K or past it
    // one pointer stepped by 4 rows: per-row addresses held across the batches would not fit PRODUCER_REGS
    const long long m = row0 + 4 * q * PB;
    const T* p = x + m * K + k;
    const int rows = (int)min((long long)M - m, (long long)4 * PB);   // rows of this batch inside M (may be <= 0)
#pragma unroll
    for (int i = 0; i < PB; ++i) {
      r[i] = (4 * i < rows && k < K) ? ld_act16(p) : make_uint4(0u, 0u, 0u, 0u);
      p += 4 * (long long)K;
    }
  };
  auto store = [&](int b, const uint4 (&r)[PB]) {
    const int v = b / QB, q = b - v * QB, s = v % SL;
    if (q == 0 && v >= SL) mbar_wait(empty0 + 8 * s, (u32)(v / SL - 1) & 1u);   // release of unit v - SL
    const u32 base = slot0 + s * (BM * 128) + (g0 + q * PB) * 512;
#pragma unroll
    for (int i = 0; i < PB; ++i) stmatrix_x4(base + i * 512 + ((i & 1) ? sw1 : sw0), r[i]);
    if (q == QB - 1) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(full0 + 8 * s);
    }
  };
  const int nb = n * QB;
  uint4 r[PRODUCER_DEPTH][PB];
#ifdef AWQ_PROBE_PRODUCER_ROUNDS
  // Probe: rounds of PRODUCER_DEPTH batches, every load of a round before any of its stores. ptxas counts all these
  // loads on one scoreboard (docs/design.md §wgmma GEMM (gemm_wg)), so the ring below waits, at each batch's first
  // store, for the batch it requested just before; here each round waits once for all of them. Faster than the ring,
  // still well behind the tile pass: registers cannot hold the bytes in flight a unit needs (same section).
  for (int b = 0; b < nb; b += PRODUCER_DEPTH) {
#pragma unroll
    for (int d = 0; d < PRODUCER_DEPTH; ++d)
      if (b + d < nb) load(b + d, r[d]);
#pragma unroll
    for (int d = 0; d < PRODUCER_DEPTH; ++d)
      if (b + d < nb) store(b + d, r[d]);
  }
#else
  // a ring of PRODUCER_DEPTH batches: once batch b is stored, its registers take batch b + PRODUCER_DEPTH
#pragma unroll
  for (int d = 0; d < PRODUCER_DEPTH; ++d)
    if (d < nb) load(d, r[d]);
  for (int b = 0; b < nb; b += PRODUCER_DEPTH) {
#pragma unroll
    for (int d = 0; d < PRODUCER_DEPTH; ++d) {
      if (b + d < nb) {
        store(b + d, r[d]);
        if (b + d + PRODUCER_DEPTH < nb) load(b + d + PRODUCER_DEPTH, r[d]);
      }
    }
  }
#endif
}
}  // namespace awq_wg

// x [M, K] -> xt [ceil(M / BM)][KS][BM][64]: per (token tile, 64-k unit) the shared-memory image the GEMM copies
// in one piece: row r holds x^T in the mma k order of the weight layout (layout.k_of_kappa), as 16-byte chunks
// stored at chunk c ^ (r % 8) of the row (awq_units::swz); zero for rows >= M and k >= K. Chunk 4 h + w of a row
// is word w of each of the four 8-k pieces x[32 h + 8 p .. + 7], p = 0..3 (the lanes' pairs of mma k16 step
// 2 h + (w >> 1), half w & 1). One thread per chunk gathers its four words (the eight threads of a row read the
// row's 128 bytes between them, through L1) and writes 16 bytes; a warp writes four whole rows. Grid-stride.
// BM is a power of two (8 x 2..32) and there are fewer than 2^31 (token tile, unit) pairs (the host checks both):
// the chunk index splits by shifts and one fastdiv (common.cuh) by KS, instead of 64-bit divisions per chunk.
template <typename T>
__global__ void __launch_bounds__(256) awq_tile_x_kernel(const T* __restrict__ x, uint4* __restrict__ xt, int M,
                                                       int K, int KS, int BM, long long chunks, u64 fd_ks) {
  pdl_trigger();   // the GEMM may launch and load its first weights meanwhile
  const int bm_log2 = __ffs(BM) - 1;
  pdl_wait();      // x may come from the previous kernel
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < chunks;
       i += (long long)gridDim.x * blockDim.x) {
    // i = (tu BM + r) 8 + c: the 64-bit index only in the loop, its parts by 32-bit shifts
    const u32 lo = (u32)i;
    const int c = (int)(lo & 7u);
    const int r = (int)(lo >> 3) & (BM - 1);
    const u32 tu = __funnelshift_r(lo, (u32)(i >> 32), 3 + bm_log2);   // token tile * KS + unit (< 2^31)
    const int mt = (int)fastdiv(tu, fd_ks);
    const int ks = (int)tu - mt * KS;
    const long long m = (long long)mt * BM + r;
    const int k = 64 * ks + 32 * (c >> 2) + 2 * (c & 3);   // word c & 3 of piece p = 0 (+ 8 p); K % 8 == 0
    u32 v[4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
      v[p] = (m < M && k + 8 * p < K) ? ld_act4(x + m * K + k + 8 * p) : 0u;
    xt[i ^ (r & 7)] = make_uint4(v[0], v[1], v[2], v[3]);   // chunk c ^ (r % 8) of its row: awq_units::swz order
  }
}

// PEND: wgmma groups left pending at each k16 step (1..3; 3 pays from 128 tokens, and the 128-token tile's PEND = 2
// variant fits two CTAs per SM; awq_cupy/kernels.py, docs/design.md §wgmma GEMM (gemm_wg)).
// KW: K streams per CTA. KW = 1: the two warpgroups take different channels (128 TW per CTA) and share each unit's
// x tile. KW = 2: both take the same 64 TW channels, warpgroup g the g-th half of the split's units, each with its
// own x slots (SLOTS / 2), mbarriers and per-unit named barrier; at the end warpgroup 1 hands its fp32 sums to
// warpgroup 0 through shared memory, which adds them (its own first) and stores. Half the channels per CTA, so
// twice the CTAs for the same split count: the split-K partials of small layers go through shared memory instead.
// XP: x [M, K] instead of the tiles, and PRODUCER_WARPS more warps after the consumers that copy it into the slots
// (awq_wg::produce_x); with KW = 2 the first half of them fills stream 0's slots, the second half stream 1's. Each
// slot has a full barrier (every producer thread of the stream arrives once its part of the unit is written) and an
// empty one (every consumer warp of the stream arrives once its wgmmas reading the unit have retired); no CTA-wide
// barrier per unit.
// The GEMM's parameters, shared by its two kernels (awq_gemm_wg_kernel, awq_gemm_wg_tma_kernel) and their body.
#define AWQ_GEMM_WG_PARAMS                                                                                      \
  const T* __restrict__ xt,         /* producers: x [M, K]; TMA: unused; else the x tiles (awq_tile_x_kernel) */ \
      const uint4* __restrict__ qtiles, /* [NT16][KS][32] weight blocks */                                      \
      const u32* __restrict__ scales,   /* [NG, Np] permuted scales, as u32 pairs */                            \
      const u32* __restrict__ zeros,    /* [NG, Np] permuted MAGIC + z, as u32 pairs */                         \
      const T* __restrict__ bias,       /* [N] or nullptr */                                                    \
      T* __restrict__ y,                /* [M, N] output (used when splits == 1) */                             \
      float* __restrict__ ws,           /* [splits, M, Np] fp32 partials (used when splits > 1) */              \
      int M, int N, int K,              /* problem size */                                                      \
      int NT16, int KS,                 /* 16-column blocks, 64-k units per block */                            \
      int G, int NG, int Np,            /* group size, number of groups, padded N */                            \
      int units_per_split,                                                                                      \
      int blk_base, /* the grid's first 16-column block (0, or a tail launch's first) */                       \
      int ws_ld     /* floats per row of ws (its columns start at channel 16 blk_base) */
#define AWQ_GEMM_WG_ARGS xt, qtiles, scales, zeros, bias, y, ws, M, N, K, NT16, KS, G, NG, Np, units_per_split, \
                         blk_base, ws_ld

// XT: x [M, K] comes by the tensor map xmap (box 64 x BM at (64 unit, m0)) in natural k order, and each warp puts
// its weight words in that order first (awq_wg::natural_k); else xt as above and xmap unused.
template <typename T, int NB, int TW, int P, bool GA, int PEND, int KW, bool XP, bool XT>
AWQ_DEVICE void awq_gemm_wg_body(AWQ_GEMM_WG_PARAMS, const TensorMap* xmap) {
  using namespace awq_wg;
  static_assert(P >= 2, "two batches of at least one unit");
  constexpr int BM = 8 * NB, SZ = GA ? 1 : 2, R = BM / 2;
  constexpr int B = P / 2;                  // units per weight batch
  static_assert(PEND >= 1 && PEND <= 3, "four fragment buffers");
  static_assert(KW == 1 || KW == 2, "one or two K streams");
  constexpr int SL = SLOTS / KW;            // x slots per K stream: SL - 2 units requested ahead
  static_assert(SL >= 3, "three x slots per K stream");
  static_assert(KW == 1 || TW * BM * 256 <= SLOTS * BM * 128, "warpgroup 1's sums fit in the x slots");
  constexpr int SLOT_BYTES = slot_bytes<NB>();
  static_assert(!XP || producers_fit<NB, TW, PEND>(), "x producers: 128 or 256 tokens, TW = 1, PEND = 3");
  static_assert(!(XP && XT), "x from producers or by the tensor map");
  using Stream = UnitStream<T, TW, SZ, BM, THREADS, false>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[XP ? 2 * SLOTS : SLOTS];   // full, then (XP) empty barriers
  // slots 1024-byte aligned (the swizzle pattern repeats every 8 rows of 128 B); the launch adds 1 KB
  const u32 raw0 = smem_addr(smem_raw);
  const u32 smem0 = (raw0 + 1023u) & ~1023u;
  const u32 bar0 = smem_addr(bars);

  pdl_trigger();   // the split-K reduce may launch now: it waits for this grid before reading the partials
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if constexpr (XP) {
    if (blockDim.x != cta_threads<XP>()) __trap();   // the launch gives the producers their warps
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) {
        mbar_init(bar0 + 8 * s, 32 * PRODUCER_WARPS / KW);
        mbar_init(bar0 + 8 * (SLOTS + s), WARPS / KW);
      }
      mbar_init_fence();
    }
    __syncthreads();   // the last CTA-wide barrier: the roles part here
    if (warp >= WARPS) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
      constexpr int TEAM = PRODUCER_WARPS / KW;
      const int pw = warp - WARPS, pkg = pw / TEAM;
      const int ub_s = blockIdx.y * units_per_split;
      const int n_s = min(KS, ub_s + units_per_split) - ub_s;
      const int hf = (n_s + KW - 1) / KW;
      const int pn = max(0, min(n_s, (pkg + 1) * hf) - pkg * hf);
      pdl_wait();   // x may come from the previous kernel
      produce_x<T, BM, TEAM, SLOTS / KW>(xt, M, K, blockIdx.z * BM, ub_s + pkg * hf, pn,
                                         smem0 + pkg * (SLOTS / KW) * SLOT_BYTES, bar0 + 8 * pkg * (SLOTS / KW),
                                         bar0 + 8 * (SLOTS + pkg * (SLOTS / KW)), pw % TEAM, lane);
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
  }
  const int kg = KW == 2 ? warp >> 2 : 0;                 // this thread's K stream
  const int ktid = KW == 2 ? (tid & 127) : tid;           // thread index inside the K stream
  const int m0 = blockIdx.z * BM;
  const int ub_split = blockIdx.y * units_per_split;
  const int n_split = min(KS, ub_split + units_per_split) - ub_split;   // units of this split (>= 1 by the plan)
  const int half = (n_split + KW - 1) / KW;
  const int ub = ub_split + kg * half;                    // this K stream's first unit
  const int n = max(0, min(n_split, (kg + 1) * half) - kg * half);   // and its units (KW = 2: may be 0)
  const int blk0 = blk_base + (blockIdx.x * (WARPS / KW) + (KW == 2 ? warp & 3 : warp)) * TW;   // its first block
  // every warp of a warpgroup issues its wgmmas; blocks past NT16 load zeros and are not stored
  Stream units(nullptr, qtiles, scales, zeros, M, K, NT16, KS, G, NG, Np, m0, ub, blk0, tid, lane);
  const u32 kslot0 = smem0 + kg * SL * SLOT_BYTES, kbar0 = bar0 + 8 * kg * SL;   // its slots and barriers
  const u32 ebar0 = bar0 + 8 * (SLOTS + kg * SL);                                  // (XP) its empty barriers
  auto request = [&](int v, int s) {   // the stream's thread 0: unit v's x tile into its slot s = v % SL
    if constexpr (XT) {   // the box at (k 64 (ub + v), row m0); its bytes are counted whole, zeros included
      mbar_expect(kbar0 + 8 * s, SLOT_BYTES);
      tma_load_2d(kslot0 + s * SLOT_BYTES, xmap, 64 * (ub + v), m0, kbar0 + 8 * s);
    } else {
      const T* xsrc = xt + ((long long)blockIdx.z * KS + ub) * (BM * 64);   // this K stream's first x tile
      bulk_load(kslot0 + s * SLOT_BYTES, xsrc + (long long)v * (BM * 64), SLOT_BYTES, kbar0 + 8 * s);
    }
  };
  // slot s, k16 step t: the descriptor of kslot0 + s SLOT_BYTES + 32 t (the start address field counts 16 bytes,
  // and shared addresses stay below its 2^18-byte range)
  const u32 desc0 = desc_lo(kslot0);

  float acc[TW][R];
#pragma unroll
  for (int i = 0; i < TW; ++i)
#pragma unroll
    for (int e = 0; e < R; ++e) acc[i][e] = 0.f;
  u32 afr[4][TW][4];   // fragment buffers of k16 steps t % 4 (zero: retire() reads a buffer before its first use)
#pragma unroll
  for (int b = 0; b < 4; ++b)
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) afr[b][i][j] = 0u;

  auto compute = [&](const typename Stream::Stage& st, u32 slot_desc, auto&& after_first) {
    uint4 wk[TW];   // the weight words in x's k order
#pragma unroll
    for (int i = 0; i < TW; ++i) wk[i] = XT ? natural_k(st.w[i], lane) : st.w[i];
#pragma unroll
    for (int h = 0; h < SZ; ++h) {
      ScaledDecoder<T> dec[TW];
#pragma unroll
      for (int i = 0; i < TW; ++i) dec[i].set(st.z[h][i], st.s[h][i]);
#pragma unroll
      for (int tt = 0; tt < 4 / SZ; ++tt) {
        const int t = h * (4 / SZ) + tt;
        wait<PEND>();                                  // step t - PEND - 1 (buffer t of the last unit) has finished
        retire(afr[(t + 3 - PEND) & 3]);               // that step's buffer: live until here (PEND <= 3)
#pragma unroll
        for (int i = 0; i < TW; ++i) dec[i].fragment(awq_units::word(wk[i], t), afr[t][i]);
        fence();
#pragma unroll
        for (int i = 0; i < TW; ++i) Wgmma<T, BM>::run(acc[i], afr[t][i], desc_sw128(slot_desc + 2 * t));
        commit();
        if (t == 0) after_first();
      }
    }
  };

  // Prologue: the first batch of weights in registers, requested before awq_tile_x_kernel has finished
  // (programmatic dependent launch, common.cuh); the x tiles and every write only after pdl_wait(). The barriers
  // are initialised before anyone waits on them.
  typename Stream::Stage sb[2][B];
#pragma unroll
  for (int j = 0; j < B; ++j)
    if (j < n) units.load(sb[0][j]);
  if constexpr (XT)
    if (ktid == 0) tma_prefetch(xmap);
  pdl_wait();
  if constexpr (!XP) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) mbar_init(bar0 + 8 * s, 1);
      mbar_init_fence();
      if constexpr (KW == 1)
        for (int v = 0; v < min(n, SL - 2); ++v) request(v, v);
    }
    __syncthreads();
    if constexpr (KW == 2) {   // after the barrier: warpgroup 1's requests need the initialised barriers
      if (ktid == 0)
        for (int v = 0; v < min(n, SL - 2); ++v) request(v, v);
    }
  }
#pragma unroll
  for (int i = 0; i < TW; ++i) pin(acc[i]);

  int slot = 0;
  u32 phase = 0;

  for (int it = 0; it < n; it += 2 * B) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < B; ++j) {
        const int u = it + h * B + j;
        if (u >= n) break;
        // slot of unit u + SL - 2 = that of unit u - 2: at the barrier after unit u - 1 every warpgroup of the
        // stream had waited for all but its last PEND <= 3 wgmma groups, which belong to unit u - 1 (four k16 steps)
        if constexpr (!XP)
          if (ktid == 0 && u + SL - 2 < n) request(u + SL - 2, slot >= 2 ? slot - 2 : slot + SL - 2);
        mbar_wait(kbar0 + 8 * slot, phase);
        compute(sb[h][j], desc0 + slot * (SLOT_BYTES >> 4), [&]() {
          if (j == 0)   // the next batch, now that this batch's loads have been waited for
#pragma unroll
            for (int jj = 0; jj < B; ++jj)
              if (u + B + jj < n) units.load(sb[h ^ 1][jj]);
        });
        if constexpr (XP) {
          // the last wait of compute(u) left at most PEND <= 3 groups pending, all of unit u: unit u - 1's slot
          // is no longer read by this warp
          if (lane == 0 && u > 0) mbar_arrive(ebar0 + 8 * (slot == 0 ? SL - 1 : slot - 1));
        }
        if (++slot == SL) {
          slot = 0;
          phase ^= 1u;
        }
        if constexpr (XP) {
        } else if constexpr (KW == 1) {
          __syncthreads();
        } else {
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + kg) : "memory");   // this stream's warpgroup only
        }
      }
  }
  wait<0>();
#pragma unroll
  for (int b = 0; b < 4; ++b) retire(afr[b]);
#pragma unroll
  for (int i = 0; i < TW; ++i) pin(acc[i]);

  if constexpr (KW == 2) {
    // Warpgroup 1's sums through the x slots (free once both streams have finished: their wgmmas are complete,
    // and the proxy fence orders those asynchronous reads before these generic writes), lane-minor so that a
    // warp's accesses do not conflict; warpgroup 0 adds them to its own and stores.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    sync_consumers();
    float* hand = reinterpret_cast<float*>(smem_raw + (smem0 - raw0));
    if (kg == 1) {
#pragma unroll
      for (int i = 0; i < TW; ++i)
#pragma unroll
        for (int e = 0; e < R; ++e) hand[(i * R + e) * 128 + ktid] = acc[i][e];
    }
    sync_consumers();
    if (kg == 1) return;
#pragma unroll
    for (int i = 0; i < TW; ++i)
#pragma unroll
      for (int e = 0; e < R; ++e) acc[i][e] += hand[(i * R + e) * 128 + ktid];
  }
#ifdef AWQ_PROBE_NOSTORE
  if (N > 0) return;   // timing probe: the sums are computed (N is unknown to the compiler) but never stored
#endif
  {
    // Staged through the x slots: for two K streams past warpgroup 1's hand-off area, which warpgroup 0 has read;
    // for one, once no warpgroup's wgmmas read the slots (the proxy fence orders those reads first). fp32
    // partials of two blocks per warp would not fit; they keep the direct stores below.
    constexpr int CH = 16 * TW * (WARPS / KW);
    constexpr u32 HAND = KW == 2 ? TW * R * 128 * 4 : 0, SPACE = SLOTS * SLOT_BYTES;
    static_assert(HAND + BM * CH * 2 <= SPACE, "the staged tile fits in the x slots");
    constexpr bool PARTIALS_FIT = HAND + BM * CH * 4 <= SPACE;
    const bool split = gridDim.y > 1;
    if (!split || PARTIALS_FIT) {
      if constexpr (KW == 1) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        sync_consumers();
      }
      const int tile_blk0 = blk_base + blockIdx.x * (WARPS / KW) * TW, c0 = 16 * tile_blk0;
      if (!split)
        store_tile_staged<T, TW, NB, CH, THREADS / KW, 1>(acc, bias, y, M, N, m0, c0, blk0 - tile_blk0,
                                                          smem0 + HAND, ktid, lane);
      else if constexpr (PARTIALS_FIT)
        store_partials_staged<TW, NB, CH, THREADS / KW, 1>(acc, ws, M, N, ws_ld, 16 * blk_base, m0, c0,
                                                           blk0 - tile_blk0, smem0 + HAND, ktid, lane);
      return;
    }
  }
  store_swapped_tile<T, TW, NB>([&](int i, int j, int e) { return acc[i][4 * j + e]; }, bias, y, ws, M, N, ws_ld,
                                16 * blk_base, m0, blk0, units.nvalid, lane);
}

// The GA PEND = 2 variant is held to 128 registers by its launch bound: two CTAs per SM are its reason to exist, and
// left to itself ptxas gives the fp16 build 131 with NVRTC 13.0 (128 with 13.5), one CTA per SM, which ran the
// 128-token layers that plan it 5-14% slower in fp16 than in bf16.
template <typename T, int NB, int TW, int P, bool GA, int PEND = (NB >= 16 ? 3 : 1), int KW = 1, bool XP = false>
__global__ void __launch_bounds__(awq_wg::cta_threads<XP>(), GA && PEND == 2 ? 2 : 1)
    awq_gemm_wg_kernel(AWQ_GEMM_WG_PARAMS) {
  awq_gemm_wg_body<T, NB, TW, P, GA, PEND, KW, XP, false>(AWQ_GEMM_WG_ARGS, nullptr);
}

// x straight from [M, K] (xt unused) by xmap, which awq_cupy.driver.TensorMap encodes on the host: rows of K
// 2-byte elements, box 64 x BM, the 128-byte swizzle, zeros outside. No x tile pass runs before it. The GA PEND = 2
// variant is held to 128 registers (two CTAs per SM, as with the pass); the reorder's registers push the others past
// it, and ptxas fits them there only by spilling.
template <typename T, int NB, int TW, int P, bool GA, int PEND = (NB >= 16 ? 3 : 1), int KW = 1>
__global__ void __launch_bounds__(awq_wg::THREADS, GA && PEND == 2 ? 2 : 1)
    awq_gemm_wg_tma_kernel(AWQ_GEMM_WG_PARAMS, const __grid_constant__ TensorMap xmap) {
  awq_gemm_wg_body<T, NB, TW, P, GA, PEND, KW, false, true>(AWQ_GEMM_WG_ARGS, &xmap);
}
