// One-query attention over the decode mirror's lanes, float32: the CPU torch backend's decode
// step (decode_attention.cpp exports it; decode_step.cpp runs it inside a whole decode step;
// prefill_attention.cpp runs its score and value blocks over a prompt's key blocks).
//
// Why a kernel of our own: per lane and KV head a decode step multiplies the GQA group's few
// query rows (1-8) with S keys, takes a softmax, and multiplies the result with S values. MKL's
// batched products run such thin shapes at a third or less of the machine's read bandwidth. Here
// each (lane, KV head) streams its keys once and its values once, and every query row of the group
// is updated from the same loaded vector, with the partial sums in registers (BENCHMARKS.md,
// "A decode-attention kernel of our own").
//
// Layout (the mirror's, common/attention/decode_mirror.py), strides in floats:
//   q    [B, heads, head_dim]              contiguous
//   k    [B, kv_heads, head_dim, s_cap]    keys transposed: a position is a column ("plain"), or
//        [B, kv_heads, s_cap / KB, head_dim, KB]  the same in blocks of KB = 64 positions ("blocked")
//   v    [B, kv_heads, s_cap, head_dim]
//   out  [B, heads, head_dim]              contiguous
//   lens [B]                               keys of each row's lane, 1 .. s_cap
// Plain keys are one block of s_cap positions: either way a block is [head_dim, width] and the
// blocks of a head follow each other.
// Row b of q and out reads lane lanes[b] of k and v (lane b when there is no lane table).
// Query head h reads KV head h / (heads / kv_heads), the HF and SGLang convention.
//
// Why blocked keys: a score block walks head_dim rows of a few vectors each. Plain, those are
// head_dim short stretches s_cap apart, more streams than the hardware prefetchers follow, so the
// keys came in at 12-15 GB/s of 27 on an AMD EPYC Zen 4 (the values, read in order, at ~25).
// Blocked, a score block of 4 vectors is one whole block, and a head's keys are read front to back.
// Contract: head_dim and s_cap are multiples of 16 (VW). Score blocks read keys up to the next
// multiple of 16 past a lane's length; those columns lie inside s_cap and their scores are never
// used.
//
// Numerics: float32 throughout; the query is scaled before the product (as SDPA's CPU kernels do).
// exp is Cephes' expf polynomial on vectors (within 2 ulp of expf over x <= 0, where it is used).
// Sums run in another order than MKL's, so results move in the last bits against the torch path.
#pragma once
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

namespace pdc::attention {

// Software prefetch (a hint: no fault even past a buffer's end) of the value row PREFETCH_ROWS
// ahead, and of plain keys (score_block's AHEAD).
constexpr int PREFETCH_ROWS = 16;

constexpr int KEY_BLOCK = 64;  // positions per block of blocked keys (4 vectors)

// Lines (64 B) of a stream's start asked for before it is read: the values' while the scores are
// still being summed into the softmax, the next (lane, KV head)'s keys as this one starts. Each item
// is two short streams (a few dozen KB) the hardware prefetchers must find anew, with gaps between
// lanes. 16 lines (1 KB): 30 layers, 8 lanes of 160-210 keys in a 256-position mirror in 4-KiB pages,
// 4-7 % less time, 32 lanes 0-3 % (one thread, AMD EPYC Zen 4, in-process alternation); 4-8 KB
// of the next item at once was 8-50 % slower (BENCHMARKS.md, "Tried on decode attention").
constexpr int START_LINES = 16;

// Scores of GB query rows against SB vectors of keys that lie side by side in their rows (within
// one block): kb points at row 0 of the first, rows ldk floats apart; the sums go to scores
// columns [s0, s0 + SB * VW). q rows pre-scaled, sums in registers. AHEAD (plain keys): ask for
// the same row of the next SB vectors meanwhile; per lane and head the hardware prefetchers alone
// kept a step at ~19 GB/s of keys and values out of ~38 a plain pass reads (Zen 5; 8 lanes x 175
// keys of SmolLM2's shape: 3.4-3.9 -> 2.3-2.5 ms). Blocked keys are read in order and need none.
template <int GB, int SB, bool AHEAD = false>
inline void score_block(const float* q, int dim, const float* kb, int64_t ldk, int s0, float* scores, int64_t lds) {
    vf acc[GB][SB];
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < SB; j++) acc[g][j] = vf{};
    for (int d = 0; d < dim; d++) {
        const float* kd = kb + d * ldk;
        if constexpr (AHEAD)
            for (int j = 0; j < SB; j++) __builtin_prefetch(kd + (SB + j) * VW);
        vf key[SB];
        for (int j = 0; j < SB; j++) key[j] = load(kd + j * VW);
        for (int g = 0; g < GB; g++) {
            vf qd = splat(q[g * dim + d]);
            for (int j = 0; j < SB; j++) acc[g][j] += qd * key[j];
        }
    }
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < SB; j++) store(scores + g * lds + s0 + j * VW, acc[g][j]);
}

// Softmax of one row of `len` scores, in place.
inline void softmax_row(float* row, int len) {
    int full = len / VW * VW;
    vf topv = splat(row[0]);
    for (int s = 0; s < full; s += VW) {
        vf x = load(row + s);
        topv = x > topv ? x : topv;
    }
    float top = row[0];
    for (int j = 0; j < VW; j++) top = topv[j] > top ? topv[j] : top;
    for (int s = full; s < len; s++) top = row[s] > top ? row[s] : top;
    vf sumv{};
    for (int s = 0; s < full; s += VW) {
        vf e = exp_nonpos(load(row + s) - top);
        store(row + s, e);
        sumv += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < VW; j++) sum += sumv[j];
    for (int s = full; s < len; s++) {
        row[s] = exp_nonpos(row[s] - top);
        sum += row[s];
    }
    float inv = 1.0f / sum;
    for (int s = 0; s < len; s++) row[s] *= inv;
}

// out[g] = sum_s p[g][s] v[s] for GB rows and head_dim columns [d0, d0 + DB * VW).
// ACC: add to what out holds (the prefill kernel's running output) instead of overwriting it.
template <int GB, int DB, bool ACC = false>
inline void value_block(const float* p, int64_t ldp, const float* v, int64_t ldv, int len, int d0, float* out, int dim) {
    vf acc[GB][DB];
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < DB; j++) acc[g][j] = ACC ? load(out + g * dim + d0 + j * VW) : vf{};
    for (int s = 0; s < len; s++) {
        const float* vs = v + s * ldv + d0;
        for (int j = 0; j < DB; j++) __builtin_prefetch(vs + PREFETCH_ROWS * ldv + j * VW);
        vf val[DB];
        for (int j = 0; j < DB; j++) val[j] = load(vs + j * VW);
        for (int g = 0; g < GB; g++) {
            vf pg = splat(p[g * ldp + s]);
            for (int j = 0; j < DB; j++) acc[g][j] += pg * val[j];
        }
    }
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < DB; j++) store(out + g * dim + d0 + j * VW, acc[g][j]);
}

// Every head_dim column of out[g] = sum_s p[g][s] v[s] (+ out[g] with ACC), four vectors at a time.
template <int GB, bool ACC = false>
inline void values(const float* p, int64_t ldp, const float* v, int64_t ldv, int len, float* out, int dim) {
    int d = 0;
    for (; d + 4 * VW <= dim; d += 4 * VW) value_block<GB, 4, ACC>(p, ldp, v, ldv, len, d, out, dim);
    for (; d < dim; d += VW) value_block<GB, 1, ACC>(p, ldp, v, ldv, len, d, out, dim);
}

// Scores of GB query rows against the first len keys of one head: plain keys (blocked false;
// ldk = s_cap) or blocks of KEY_BLOCK (ldk unused). Every score sums over head_dim in order,
// whatever the grouping, so both layouts give the same bits.
template <int GB>
inline void scores_of(const float* q, int dim, const float* kt, int64_t ldk, bool blocked, int len, float* scores,
                      int64_t lds) {
    const int nvec = (len + VW - 1) / VW;
    if (blocked) {
        constexpr int W = KEY_BLOCK / VW;
        for (int b0 = 0; b0 < nvec; b0 += W) {
            const float* kb = kt + static_cast<int64_t>(b0 / W) * dim * KEY_BLOCK;  // one [dim, KEY_BLOCK] block
            if (nvec - b0 >= W)
                score_block<GB, W>(q, dim, kb, KEY_BLOCK, b0 * VW, scores, lds);
            else  // the last, partly used block: a vector at a time
                for (int j = 0; b0 + j < nvec; j++)
                    score_block<GB, 1>(q, dim, kb + j * VW, KEY_BLOCK, (b0 + j) * VW, scores, lds);
        }
        return;
    }
    // GB * SB accumulators and SB keys in registers: 6 key vectors up to 2 rows, and for 3 rows with
    // AVX-512 (25 of its 32 registers; SmolLM2's 9/3 heads, 30 layers, 8-32 lanes x 185-400 keys:
    // 3-7 % faster than 4), 4 beyond.
#ifdef __AVX512F__
    constexpr int SB = GB <= 3 ? 6 : 4;
#else
    constexpr int SB = GB <= 2 ? 6 : 4;
#endif
    int j = 0;
    for (; j + SB <= nvec; j += SB) score_block<GB, SB, true>(q, dim, kt + j * VW, ldk, j * VW, scores, lds);
    for (; j < nvec; j++) score_block<GB, 1, true>(q, dim, kt + j * VW, ldk, j * VW, scores, lds);
}

// GB (1-4) query rows of one KV head: scores, softmax, values. q is pre-scaled.
template <int GB>
void attend_rows(const float* q, int dim, const float* kt, int64_t ldk, bool blocked, const float* v, int64_t ldv,
                 int len, float* scores, int64_t lds, float* out) {
    scores_of<GB>(q, dim, kt, ldk, blocked, len, scores, lds);
    for (int r = 0; r < START_LINES; r++) __builtin_prefetch(v + r * VW);
    for (int g = 0; g < GB; g++) softmax_row(scores + g * lds, len);
    values<GB>(scores, lds, v, ldv, len, out, dim);
}

// Every (row, KV head) of a batch, split over `num_threads` OpenMP threads. Row b reads lane
// lanes[b] (b itself when lanes is null) and its first lens[b] keys; `blocked`: the keys' layout
// (above). scratch: num_threads * (heads / kv_heads) * (s_cap + head_dim) floats, each thread its
// own slice (scores, then the group's scaled queries).
template <typename Len>
void run(const float* q, const float* k, const float* v, float* out, const int64_t* lanes, const Len* lens,
         float* scratch, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t s_cap, bool blocked,
         int64_t k_lane_stride, int64_t v_lane_stride, float scale, int num_threads) {
    const int64_t group = heads / kv_heads, items = batch * kv_heads;
    const int64_t slice = group * (s_cap + dim);
    if (num_threads > items) num_threads = static_cast<int>(items);
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / kv_heads, h = it % kv_heads, lane = lanes == nullptr ? b : lanes[b];
#ifdef _OPENMP
        float* scores = scratch + omp_get_thread_num() * slice;
#else
        float* scores = scratch;
#endif
        float* qs = scores + group * s_cap;
        const float* qh = q + (b * heads + h * group) * dim;
        for (int64_t i = 0; i < group * dim; i++) qs[i] = qh[i] * scale;
        const float* kt = k + lane * k_lane_stride + h * dim * s_cap;  // a head's keys: dim * s_cap either way
        const float* vh = v + lane * v_lane_stride + h * s_cap * dim;
        float* oh = out + (b * heads + h * group) * dim;
        const int len = static_cast<int>(lens[b]), d = static_cast<int>(dim);
        if (it + 1 < items) {  // the next item's keys (START_LINES)
            const int64_t nb = (it + 1) / kv_heads, nh = (it + 1) % kv_heads;
            const float* next = k + (lanes == nullptr ? nb : lanes[nb]) * k_lane_stride + nh * dim * s_cap;
            for (int r = 0; r < START_LINES; r++) __builtin_prefetch(next + r * VW);
        }
        for (int64_t g = 0; g < group;) {
            const int64_t left = group - g;
            float* sg = scores + g * s_cap;
            const float* qg = qs + g * dim;
            float* og = oh + g * dim;
            if (left >= 4) { attend_rows<4>(qg, d, kt, s_cap, blocked, vh, dim, len, sg, s_cap, og); g += 4; }
            else if (left == 3) { attend_rows<3>(qg, d, kt, s_cap, blocked, vh, dim, len, sg, s_cap, og); g += 3; }
            else if (left == 2) { attend_rows<2>(qg, d, kt, s_cap, blocked, vh, dim, len, sg, s_cap, og); g += 2; }
            else { attend_rows<1>(qg, d, kt, s_cap, blocked, vh, dim, len, sg, s_cap, og); g += 1; }
        }
    }
}

}  // namespace pdc::attention
