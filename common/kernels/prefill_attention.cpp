// Causal attention of a prompt's new tokens after a cached prefix, float32: the CPU torch
// backend's prefill and extend (common/kernels/__init__.py builds and loads it; plain C ABI).
//
// Why a kernel of our own: SDPA's CPU flash kernel ran a 512-token prompt of SmolLM2's shape at
// ~70 GFLOP/s (126 of its ~650 ms, 64-query blocks) and is slower still on long causal squares;
// the projections around it run at ~250. Here the query heads of one KV head are the rows of one
// product, so each key and value block is loaded once for the whole GQA group, and the keys are
// transposed once per call so that scores are register tiles of whole key vectors. The tiles are
// attention.h's score and value blocks, the decode kernel's own.
//
// Algorithm (flash attention, one pass): per item (request, KV head, block of QB query tokens),
// rows = the block's tokens x the group's query heads; over key blocks of KB up to the block's
// last position: scores in registers, the causal cut on the diagonal block, an online softmax
// (running max and sum per row, the output rescaled when the max moves), then the values
// accumulated into the row's output. Keys after a row's own position are never read as weights.
//
// Layout, contiguous float32:
//   q, out [G, E, heads, head_dim]          E new tokens of each of G requests
//   k, v   [G, prefix + E, kv_heads, head_dim]
// Token t of request g sits at position prefix + t and sees keys 0 .. prefix + t.
// Query head h reads KV head h / (heads / kv_heads), the HF and SGLang convention.
// Contract: head_dim is a multiple of 16 (VW).
//
// Numerics: float32 throughout; the query is scaled before the product (as SDPA's CPU kernels do);
// exp is simd.h's exp_nonpos. Sums run in another order than SDPA's, so results move in the last
// bits against it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention.h"

namespace pdc::prefill {

constexpr int QB = 32;  // query tokens per item
constexpr int KB = 64;  // keys per block: 4 vectors of scores per row
constexpr int RT = 6;   // rows per register tile: 6 x 4 sums + 4 loaded vectors + a broadcast

// op(std::integral_constant<int, R>{}, r0) for rows [r0, r0 + R) in tiles of RT and one shorter.
template <typename Op>
inline void by_tiles(int rows, Op op) {
    for (int r = 0; r < rows; r += RT) {
        switch (std::min(RT, rows - r)) {
            case 6: op(std::integral_constant<int, 6>{}, r); break;
            case 5: op(std::integral_constant<int, 5>{}, r); break;
            case 4: op(std::integral_constant<int, 4>{}, r); break;
            case 3: op(std::integral_constant<int, 3>{}, r); break;
            case 2: op(std::integral_constant<int, 2>{}, r); break;
            default: op(std::integral_constant<int, 1>{}, r); break;
        }
    }
}

// Softmax step of one row over its `valid` scores of this block (the rest of the KB set to zero):
// p in place of the scores, the running max m and sum l updated; returns the factor by which the
// row's output so far must be scaled.
inline float online_row(float* s, int valid, float& m, float& l) {
    const float ninf = -INFINITY;
    for (int c = valid; c < KB; c++) s[c] = ninf;
    vf top = load(s);
    for (int j = 1; j < KB / VW; j++) {
        vf x = load(s + j * VW);
        top = x > top ? x : top;
    }
    const float bmax = hmax_tree(top);
    const float m_new = bmax > m ? bmax : m;
    const float alpha = m == ninf ? 0.0f : exp_nonpos(m - m_new);
    vf sum{};
    const vf mv = splat(m_new);
    for (int j = 0; j < KB / VW; j++) {
        vf e = exp_nonpos(load(s + j * VW) - mv);  // -inf - m_new is below exp_nonpos's floor: 0
        store(s + j * VW, e);
        sum += e;
    }
    l = l * alpha + hsum_tree(sum);
    m = m_new;
    return alpha;
}

void run(const float* q, const float* k, const float* v, float* out, int64_t G, int64_t E, int64_t prefix,
         int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    const int64_t group = heads / kv_heads, S = prefix + E, s_pad = (S + KB - 1) / KB * KB;
    const int64_t q_tok = heads * dim, kv_tok = kv_heads * dim, qblocks = (E + QB - 1) / QB;
    // Keys transposed once per call, [G, kv_heads, head_dim, s_pad], columns past S zero: every
    // query block after a key block reads it again.
    std::vector<float> kt_all(static_cast<size_t>(G * kv_heads * dim * s_pad), 0.0f);
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t gh = 0; gh < G * kv_heads; gh++) {
        const int64_t g = gh / kv_heads, h = gh % kv_heads;
        float* kt = kt_all.data() + gh * dim * s_pad;
        for (int64_t c = 0; c < S; c++) {
            const float* kr = k + (g * S + c) * kv_tok + h * dim;
            for (int64_t d = 0; d < dim; d++) kt[d * s_pad + c] = kr[d];
        }
    }
    const int64_t items = G * kv_heads * qblocks, rows_max = QB * group;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        std::vector<float> qs(rows_max * dim), o(rows_max * dim), s(rows_max * KB), m(rows_max), l(rows_max);
        // Later query blocks read more keys: hand items out one at a time, the longest first.
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g = it / (kv_heads * qblocks), h = it / qblocks % kv_heads;
            const int64_t qb = qblocks - 1 - it % qblocks;
            const int64_t t0 = qb * QB, nt = std::min<int64_t>(QB, E - t0);
            const int rows = static_cast<int>(nt * group), d = static_cast<int>(dim);
            // Row r = t * group + j: query head h * group + j of token t0 + t, pre-scaled.
            for (int64_t t = 0; t < nt; t++)
                for (int64_t j = 0; j < group; j++) {
                    const float* src = q + (g * E + t0 + t) * q_tok + (h * group + j) * dim;
                    float* dst = qs.data() + (t * group + j) * dim;
                    for (int64_t x = 0; x < dim; x++) dst[x] = src[x] * scale;
                }
            std::fill(o.begin(), o.begin() + rows * dim, 0.0f);
            std::fill(m.begin(), m.begin() + rows, -INFINITY);
            std::fill(l.begin(), l.begin() + rows, 0.0f);
            const float* kt = kt_all.data() + (g * kv_heads + h) * dim * s_pad;
            const float* vh = v + g * S * kv_tok + h * dim;
            const int64_t first_pos = prefix + t0, kend = prefix + t0 + nt;  // keys [0, kend)
            for (int64_t kb0 = 0; kb0 < kend; kb0 += KB) {
                const int kb = static_cast<int>(std::min<int64_t>(KB, kend - kb0));
                // Scores of a tile of rows against this block's KB keys: attention.h's score block.
                by_tiles(rows, [&](auto R, int r0) {
                    attention::score_block<decltype(R)::value, KB / VW, true>(qs.data() + r0 * dim, d, kt + kb0, s_pad,
                                                                             0, s.data() + r0 * KB, KB);
                });
                for (int r = 0; r < rows; r++) {
                    const int64_t pos = first_pos + r / group;  // this row's token's position
                    const int valid = static_cast<int>(std::min<int64_t>(kb, pos - kb0 + 1));
                    float* sr = s.data() + r * KB;
                    if (valid <= 0) {  // every key of this block is after the row's token
                        std::fill(sr, sr + KB, 0.0f);
                        continue;
                    }
                    const float alpha = online_row(sr, valid, m[r], l[r]);
                    if (alpha != 1.0f) {
                        const vf av = splat(alpha);
                        float* orow = o.data() + r * dim;
                        for (int x = 0; x < d; x += VW) store(orow + x, load(orow + x) * av);
                    }
                }
                // The block's values added to the rows' running outputs.
                by_tiles(rows, [&](auto R, int r0) {
                    attention::values<decltype(R)::value, true>(s.data() + r0 * KB, KB, vh + kb0 * kv_tok, kv_tok, kb,
                                                                o.data() + r0 * dim, d);
                });
            }
            for (int64_t t = 0; t < nt; t++)
                for (int64_t j = 0; j < group; j++) {
                    const int64_t r = t * group + j;
                    const float inv = 1.0f / l[r];
                    const float* src = o.data() + r * dim;
                    float* dst = out + (g * E + t0 + t) * q_tok + (h * group + j) * dim;
                    for (int64_t x = 0; x < dim; x++) dst[x] = src[x] * inv;
                }
        }
    }
}

}  // namespace pdc::prefill

extern "C" void pdc_prefill_attention(const float* q, const float* k, const float* v, float* out, int64_t G, int64_t E,
                                      int64_t prefix, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                                      int num_threads) {
    pdc::prefill::run(q, k, v, out, G, E, prefix, heads, kv_heads, dim, scale, num_threads);
}
