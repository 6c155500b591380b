// y[M, N] = x[M, K] W^T (+ bias), float32, over a weight blocked by output columns: the CPU
// projections' kernel (linear.cpp exports it for `--cpu-linear native`; decode_step.cpp runs it
// inside a whole decode step). common/models/linear.py packs the weights.
//
// Why: a decode step multiplies a few rows by every weight, so it streams the weights once and is
// bound by memory at 1-8 rows. oneDNN's packed kernel read them at ~80 % of the machine's read
// bandwidth for one row and ~57 % for eight; here each block of 32 output columns is read once,
// contiguously, for all the rows, with the rows' sums in registers (BENCHMARKS.md, "Projections
// of our own").
//
// Layout: W blocked [ceil(N / 32)][K][32]: block b holds output columns 32b .. 32b + 31 for every
// input k, the columns past N zero. x rows are ldx apart, y rows ldy apart.
#pragma once
#include <cstdint>

#include "simd.h"

namespace pdc::linear {

constexpr int NB = 2 * VW;  // output columns per block
// Rows per register tile: 12 x 2 accumulators + 2 weight vectors + a broadcast, 27 of AVX-512's 32
// registers. One tile reads a weight block from memory; each further tile of the same rows pass
// re-reads it from L2 and is bound by its FMAs, so the fewer tiles the better. 30 layers of
// SmolLM2's projections, one thread, Zen 5: 32 rows 31.4 ms in tiles of 8 (216 GFLOP/s), 28.1 in
// tiles of 12 (242); 14-row tiles were within noise at 16-24 rows and slower at 32 (12 + 12 + 8
// against 14 + 14 + 4). A row's sums run over k in order in every tile size, so its result does not
// depend on which tile, or which batch, it falls in. Without AVX-512 a vector is two of AVX2's 16
// registers and the tile spills either way; there it stays at 8, as it was (not measured since).
#ifdef __AVX512F__
constexpr int MR = 12;
#else
constexpr int MR = 8;
#endif
#ifndef MC_ROWS
#define MC_ROWS 128
#endif
constexpr int MC = MC_ROWS;  // rows per pass over the weights: their inputs stay in L2
// Software prefetch this many k ahead (8 KiB of the block). At 8 rows a k step takes ~20 cycles,
// so the hardware's own prefetch, and ours at 8 ahead, arrived late: 30 layers of SmolLM2's
// projections at 8 rows took 16.1 ms at 8 ahead, 14.5-14.6 at 16-32, 12.9 at 64, 11.8 at 128 and
// 12.8 at 256 (one thread, AMD EPYC Zen 5; oneDNN's packed kernel: 18.1-18.6 ms). That was with
// the weights in 4-KiB pages. In 2-MiB pages (common/hugepages.py, where the packed weights live)
// 64 ahead is best: 8 rows 11.0 ms (38.6 GB/s) against 11.6 at 128; one row 10.5 either way.
// Into L2, not L1 (prefetcht1, locality 2): at 8 rows the FMAs and the weights' stream are both
// near their limits, and (our reading) a prefetch into L1 holds one of L1's few miss buffers until
// its line comes. On an AMD EPYC Zen 4 (27 GB/s, 111 GFLOP/s on one thread) 8 rows took 19.0 ms
// into L1 and 16.3 into L2 (89 -> 104 GFLOP/s), 12 rows 25.8 -> 23.0, 32 rows 64.5 -> 61.4, one
// row the same (14.8-15.1); prefill unchanged. Into L2, distances of 64-192 k were alike at 8
// rows; 256 and 384 cost one row 20-60 %. prefetchnta was as slow as L1 (docs/BENCHMARKS.md,
// "Prefetch into L2, one arena for the weights"). Not yet measured on Zen 5.
// Only tiles of more than PREFETCH_MIN_ROWS - 1 rows prefetch: with few rows a k step is a few
// cycles, the loads run far ahead of the FMAs and the hardware's stream prefetcher keeps up, and
// our prefetches only took load-queue and miss-buffer slots. 30 layers of SmolLM2's projections,
// one thread, Zen 4, six alternated pairs at one row: 17.2-17.9 ms with the prefetch, 15.1-15.5
// without (28 GB/s, the read limit of 2-MiB pages); 2 rows 20.6-21.6 -> 15.3, 3 rows 20.8-21.6 ->
// 15.9-16.6, 4 rows 18.3-19.2 -> 16.5-17.2, 5 rows 20.3-22.3 -> 17.6-17.8, 6 rows 17.8-19.5 ->
// 17.2-18.8; at 7 rows the prefetch won (17.2-19.9 against 18.7-19.3), at 8 clearly (17.7-19.2
// against 19.8-20.5) (docs/BENCHMARKS.md, "Few rows stream without our prefetch"). Zen 5 and
// AVX2 machines take the same rule unmeasured.
constexpr int PREFETCH_K = 64;
constexpr int PREFETCH_LOCALITY = 2;
constexpr int PREFETCH_MIN_ROWS = 7;

// Rows [0, R) of x times one weight block, into columns [0, cols) of y (cols < NB: the last block).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* wb, int64_t K, const float* bias, float* y, int64_t ldy,
                 int cols) {
    vf acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vf{};
    for (int64_t k = 0; k < K; k++) {
        const float* w = wb + k * NB;
        if constexpr (R >= PREFETCH_MIN_ROWS) {
            __builtin_prefetch(w + PREFETCH_K * NB, 0, PREFETCH_LOCALITY);
            __builtin_prefetch(w + PREFETCH_K * NB + VW, 0, PREFETCH_LOCALITY);
        }
        vf w0 = load(w), w1 = load(w + VW);
        for (int r = 0; r < R; r++) {
            vf xr = splat(x[r * ldx + k]);
            acc[r][0] += xr * w0;
            acc[r][1] += xr * w1;
        }
    }
    if (bias != nullptr) {
        float b[NB] = {};
        for (int c = 0; c < cols; c++) b[c] = bias[c];
        vf b0 = load(b), b1 = load(b + VW);
        for (int r = 0; r < R; r++) acc[r][0] += b0, acc[r][1] += b1;
    }
    if (cols == NB) {
        for (int r = 0; r < R; r++) store(y + r * ldy, acc[r][0]), store(y + r * ldy + VW, acc[r][1]);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < cols; c++) y[r * ldy + c] = c < VW ? acc[r][0][c] : acc[r][1][c - VW];
}

// Rows [0, n) in one tile of n rows (n <= 14 with AVX-512, 11 without).
inline void tile_rows(const float* xr, int64_t ldx, int64_t n, const float* wb, int64_t K, const float* bias,
                      float* yr, int64_t ldy, int cols) {
    switch (n) {
#ifdef __AVX512F__
        case 14: tile<14>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 13: tile<13>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 12: tile<12>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
#endif
        case 11: tile<11>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 10: tile<10>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 9: tile<9>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 8: tile<8>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 7: tile<7>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 6: tile<6>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 5: tile<5>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 4: tile<4>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 3: tile<3>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 2: tile<2>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        case 1: tile<1>(xr, ldx, wb, K, bias, yr, ldy, cols); break;
        default: break;
    }
}

// A last tile this short runs below the FMAs' throughput, so it shares with the tile before it.
// One or two rows (2-4 chains of sums, bound by FMA latency) join it: 12 + 1 -> 13, 30 layers of
// SmolLM2's projections: 15.1 -> 12.4 ms at 13 rows, 15.2 -> 13.0 at 14, 25.3 -> 22.6 at 25. With
// AVX-512, three or four rows (a tile re-reading the block from L2 with few sums per weight load)
// split the rows with the tile before: 12 + 4 -> 8 + 8. AMD EPYC Zen 4, one thread: 16 rows 33.4
// -> 30.8 ms, 15 rows 31.3 -> 29.1, 28 rows 55.8 -> 53.4, 40 rows 79.4 -> 75.6; 17-26 and 29-39
// rows were the same or slower split evenly, so only these move (docs/BENCHMARKS.md, "Short last
// tiles"). AVX2 keeps 8-row tiles with 1-2 rows joined, as measured before.
#ifdef __AVX512F__
constexpr int SPLIT_LAST_UP_TO = 4;
#else
constexpr int SPLIT_LAST_UP_TO = 2;
#endif

inline void rows(const float* x, int64_t ldx, int64_t m, const float* wb, int64_t K, const float* bias, float* y,
                 int64_t ldy, int cols) {
    const int64_t rem = m % MR;
    const int64_t full = m > MR && rem > 0 && rem <= SPLIT_LAST_UP_TO ? m / MR - 1 : m / MR;
    int64_t r = 0;
    for (int64_t t = 0; t < full; t++, r += MR) tile<MR>(x + r * ldx, ldx, wb, K, bias, y + r * ldy, ldy, cols);
    if (m - r > MR + 2) {  // MR + 3 or MR + 4 rows left: two tiles of about half each
        const int64_t h = (m - r + 1) / 2;
        tile_rows(x + r * ldx, ldx, h, wb, K, bias, y + r * ldy, ldy, cols);
        r += h;
    }
    tile_rows(x + r * ldx, ldx, m - r, wb, K, bias, y + r * ldy, ldy, cols);
}

// The whole product, output blocks split over `num_threads` OpenMP threads.
inline void run(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wb, int64_t N, const float* bias,
                float* y, int64_t ldy, int num_threads) {
    const int64_t blocks = (N + NB - 1) / NB;
    if (num_threads > blocks) num_threads = static_cast<int>(blocks);
    if (num_threads < 1) num_threads = 1;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t m = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
        for (int64_t b = 0; b < blocks; b++) {
            const int cols = N - b * NB < NB ? static_cast<int>(N - b * NB) : NB;
            rows(x + m0 * ldx, ldx, m, wb + b * K * NB, K, bias == nullptr ? nullptr : bias + b * NB,
                 y + m0 * ldy + b * NB, ldy, cols);
        }
    }
}

}  // namespace pdc::linear
