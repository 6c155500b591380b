// A whole decode step of a Llama-family model (Llama, Qwen2, Qwen3) in one call, float32 on the
// CPU: every layer's norms, projections, RoPE, K/V writes and attention over the decode mirror,
// then the final norm. common/models/native_decode.py drives it (one ctypes call per step);
// common/kernels/__init__.py builds and loads it.
//
// Why: with our projection and attention kernels a decode step of SmolLM2-135M's shape at one row
// spent 11.5 ms in projections and ~5 ms more in the ~20 torch ops per layer between them (norms,
// RoPE, residual adds, SiLU-mul, the K/V writes, each a dispatch of a few microseconds on a few
// hundred floats) and in Python (BENCHMARKS.md, "A decode step in one call"). Here those ops are
// loops over the batch's rows, in cache, between the same two kernels (linear.h, attention.h).
//
// Before the first layer each row's token is looked up in the embedding (plain [vocab, hidden]
// rows, or the packed tied head's layout, linear.h) and its RoPE angles computed from inv_freq.
// Per layer, for the batch's B rows in batch order (res: the residual stream, x: the last
// sublayer's output; layer 0 starts from the embeddings as its residual):
//   res += x;  h = rms_norm(res) * input_norm
//   qkv = h Wqkv^T (+ b);  q, k = rope(q_norm(q), k_norm(k))  (per-head norms: Qwen3 only)
//   k, v -> the KV pool at slots[b] (what transfer and the prefix cache read) and the mirror lane
//   lanes[b] at positions[b];  a = attention(q, lane, lens[b] keys)
//   res += a Wo^T (+ b);  h = rms_norm(res) * post_norm;  x = (silu(g) * u) Wdown^T, g | u = h Wgu^T
// and after the last layer: out = rms_norm(res + x) * final_norm, and logits = out head^T where
// the head is packed for linear.h (Python runs any other head).
//
// Why the ends too: the embedding lookup, the RoPE tables and the head's own call were ~0.5 ms of
// torch ops and calls around a one-row step of SmolLM2's shape (~18 ms); with them here the step's
// time outside this call fell from 1.03 to 0.68 ms (BENCHMARKS.md, "The step's ends in the kernel").
//
// Numerics: float32 as the torch path, with sums in other orders (the norms' sums of squares in
// 16 partial sums, the kernels' as linear.h and attention.h say) and SiLU through Cephes' exp:
// results move in the last bits against the torch ops, as with any kernel change.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"
#include "linear.h"
#include "simd.h"

namespace {

using namespace pdc;

// One layer's tensors (common/kernels/__init__.py: DecodeStep's ctypes mirror of this struct).
struct Layer {
    const float* input_norm;
    const float* post_norm;
    const float* q_norm;  // null: no per-head norms
    const float* k_norm;
    const float* qkv;  // packed as linear.h says, [q heads | kv heads | kv heads] output columns
    const float* qkv_bias;  // null: none (and the same for the biases below)
    const float* o;
    const float* o_bias;
    const float* gate_up;  // [gate | up] output columns
    const float* gate_up_bias;
    const float* down;
    const float* down_bias;
    float* k_pool;  // [slots, kv_heads, head_dim]
    float* v_pool;
    float* k_mirror;  // [lanes, kv_heads, head_dim, s_cap], or in blocks of 16 positions (Shape::blocked_keys)
    float* v_mirror;  // [lanes, kv_heads, s_cap, head_dim]
};

struct Shape {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, s_cap;
    int64_t blocked_keys;  // the mirror's key layout (attention.h): 0 plain, 1 blocked
    float eps, scale;
};

// The model's ends (common/kernels/__init__.py: DecodeStep.Model).
struct Model {
    const float* embed;  // [embed_rows, hidden], or packed [ceil(embed_rows / NB)][hidden][NB] (embed_packed)
    int64_t embed_rows, embed_packed;
    const float* inv_freq;  // [head_dim / 2] RoPE angle per position of each rotated pair
    const float* final_norm;
    const float* head;  // packed for linear.h, [vocab] output columns; null: the caller runs the head
    int64_t vocab;
};

// Scratch floats of each buffer, in the order they lie in the caller's scratch.
struct Scratch {
    float *cos, *sin, *res, *h, *qkv, *q, *att, *tmp, *gu, *act, *attn;
    Scratch(const Shape& s, int64_t b, float* base) {
        cos = base;
        sin = cos + b * s.head_dim;
        res = sin + b * s.head_dim;
        h = res + b * s.hidden;
        qkv = h + b * s.hidden;
        q = qkv + b * (s.heads + 2 * s.kv_heads) * s.head_dim;
        att = q + b * s.heads * s.head_dim;
        tmp = att + b * s.heads * s.head_dim;
        gu = tmp + b * s.hidden;
        act = gu + b * 2 * s.inter;
        attn = act + b * s.inter;
    }
    static int64_t floats(const Shape& s, int64_t b, int threads) {
        const int64_t rows = b * (3 * s.hidden + (3 * s.heads + 2 * s.kv_heads + 2) * s.head_dim + 3 * s.inter);
        return rows + threads * (s.heads / s.kv_heads) * (s.s_cap + s.head_dim);  // attention.h's scratch
    }
};

// y[n] = x[n] / rms(x) * w[n] (torch.rms_norm's order: normalise, then the weight).
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
    vf acc{};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf v = load(x + i);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    i = 0;
    for (; i + VW <= n; i += VW) store(y + i, load(x + i) * inv * load(w + i));
    for (; i < n; i++) y[i] = x[i] * inv * w[i];
}

void add(float* acc, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) store(acc + i, load(acc + i) + load(x + i));
    for (; i < n; i++) acc[i] += x[i];
}

// One head, d floats: optional per-head norm, then RoPE's rotate-half with the sign folded into
// sin (out[i] = x[i] cos[i] + x[(i + d/2) % d] sin_signed[i]).
void norm_rope(const float* x, const float* norm, float eps, const float* cos, const float* sin, float* out,
               int64_t d) {
    float buf[512];  // head_dim <= 512 (checked by the caller)
    if (norm != nullptr) {
        rms_norm(x, norm, buf, d, eps);
        x = buf;
    }
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

// cos and sin_signed [d] of one position: what the torch path builds (common/models/rope.py:
// angle = float(pos) * inv_freq[i % (d/2)] in float32, cos | cos and -sin | sin), the sign of
// rotate-half folded into sin as norm_rope takes it.
void rope_row(int64_t pos, const float* inv_freq, int64_t d, float* cos, float* sin_signed) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float angle = static_cast<float>(pos) * inv_freq[i];
        const float c = std::cos(angle), sn = std::sin(angle);
        cos[i] = cos[i + half] = c;
        sin_signed[i] = -sn;
        sin_signed[i + half] = sn;
    }
}

// Row `id` of the embedding: a plain row, or column id % NB of block id / NB in the packed layout.
void embed_row(const Model& m, int64_t id, int64_t hidden, float* out) {
    if (!m.embed_packed) {
        std::memcpy(out, m.embed + id * hidden, sizeof(float) * hidden);
        return;
    }
    constexpr int64_t NB = linear::NB;
    const float* block = m.embed + (id / NB) * hidden * NB + id % NB;
    for (int64_t k = 0; k < hidden; k++) out[k] = block[k * NB];
}

// act[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, with e^-|g| so the exponent never overflows.
void silu_mul(const float* g, const float* u, float* act, int64_t n) {
    int64_t i = 0;
    const vf one = splat(1.0f);
    for (; i + VW <= n; i += VW) {
        vf x = load(g + i);
        vf ax = x < 0 ? -x : x;
        vf t = exp_nonpos(-ax);
        vf sig = x < 0 ? t / (one + t) : one / (one + t);
        store(act + i, x * sig * load(u + i));
    }
    for (; i < n; i++) act[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace

extern "C" int64_t pdc_decode_step_scratch(const Shape* shape, int64_t batch, int num_threads) {
    return Scratch::floats(*shape, batch, num_threads < 1 ? 1 : num_threads);
}

// ids [B]: the step's tokens; slots, lanes, positions, lens [B]: each row's pool slot for its new
// token, its mirror lane, the token's position and the keys it attends (position + 1).
// out [B, hidden]: the final norm's output; logits [B, vocab]: written where the model has a head.
// Returns 0, or -1 (nothing written, the KV pool and mirror untouched) when a token id is not a row
// of the embedding.
extern "C" int pdc_decode_step(const Layer* layers, const Shape* shape, const Model* model, int64_t batch,
                                const int64_t* ids, const int64_t* slots, const int64_t* lanes,
                                const int64_t* positions, const int64_t* lens, float* out, float* logits,
                                float* scratch, int num_threads) {
    const Shape& s = *shape;
    const Model& m = *model;
    if (num_threads < 1) num_threads = 1;
    const int64_t H = s.hidden, d = s.head_dim, q_size = s.heads * d, kv_size = s.kv_heads * d;
    const int64_t n_qkv = q_size + 2 * kv_size, I = s.inter;
    const int64_t k_lane = s.kv_heads * d * s.s_cap, v_lane = k_lane;
    Scratch sc(s, batch, scratch);
    for (int64_t b = 0; b < batch; b++)
        if (ids[b] < 0 || ids[b] >= m.embed_rows) return -1;
    const float *cos = sc.cos, *sin_signed = sc.sin;
    for (int64_t b = 0; b < batch; b++) {
        embed_row(m, ids[b], H, sc.res + b * H);
        rope_row(positions[b], m.inv_freq, d, sc.cos + b * d, sc.sin + b * d);
    }
    for (int64_t l = 0; l < s.layers; l++) {
        const Layer& L = layers[l];
        for (int64_t b = 0; b < batch; b++) {
            if (l > 0) add(sc.res + b * H, sc.tmp + b * H, H);
            rms_norm(sc.res + b * H, L.input_norm, sc.h + b * H, H, s.eps);
        }
        linear::run(sc.h, batch, H, H, L.qkv, n_qkv, L.qkv_bias, sc.qkv, n_qkv, num_threads);
        for (int64_t b = 0; b < batch; b++) {
            const float* row = sc.qkv + b * n_qkv;
            const float *c = cos + b * d, *sn = sin_signed + b * d;
            for (int64_t h = 0; h < s.heads; h++)
                norm_rope(row + h * d, L.q_norm, s.eps, c, sn, sc.q + b * q_size + h * d, d);
            const int64_t lane = lanes[b], pos = positions[b];
            for (int64_t h = 0; h < s.kv_heads; h++) {
                float* kp = L.k_pool + slots[b] * kv_size + h * d;
                float* vp = L.v_pool + slots[b] * kv_size + h * d;
                norm_rope(row + q_size + h * d, L.k_norm, s.eps, c, sn, kp, d);
                std::memcpy(vp, row + q_size + kv_size + h * d, sizeof(float) * d);
                // Column pos of [d, s_cap], or column pos % KB of block pos / KB's [d, KB].
                constexpr int64_t KB = attention::KEY_BLOCK;
                float* km = L.k_mirror + lane * k_lane + h * d * s.s_cap +
                            (s.blocked_keys ? (pos / KB) * d * KB + pos % KB : pos);
                const int64_t k_row = s.blocked_keys ? KB : s.s_cap;
                float* vm = L.v_mirror + lane * v_lane + (h * s.s_cap + pos) * d;
                for (int64_t i = 0; i < d; i++) km[i * k_row] = kp[i];
                std::memcpy(vm, vp, sizeof(float) * d);
            }
        }
        attention::run(sc.q, L.k_mirror, L.v_mirror, sc.att, lanes, lens, sc.attn, batch, s.heads, s.kv_heads, d,
                       s.s_cap, s.blocked_keys != 0, k_lane, v_lane, s.scale, num_threads);
        linear::run(sc.att, batch, q_size, q_size, L.o, H, L.o_bias, sc.tmp, H, num_threads);
        for (int64_t b = 0; b < batch; b++) {
            add(sc.res + b * H, sc.tmp + b * H, H);
            rms_norm(sc.res + b * H, L.post_norm, sc.h + b * H, H, s.eps);
        }
        linear::run(sc.h, batch, H, H, L.gate_up, 2 * I, L.gate_up_bias, sc.gu, 2 * I, num_threads);
        for (int64_t b = 0; b < batch; b++) silu_mul(sc.gu + b * 2 * I, sc.gu + b * 2 * I + I, sc.act + b * I, I);
        linear::run(sc.act, batch, I, I, L.down, H, L.down_bias, sc.tmp, H, num_threads);
    }
    for (int64_t b = 0; b < batch; b++) {
        add(sc.res + b * H, sc.tmp + b * H, H);
        rms_norm(sc.res + b * H, m.final_norm, out + b * H, H, s.eps);
    }
    if (m.head != nullptr) linear::run(out, batch, H, H, m.head, m.vocab, nullptr, logits, m.vocab, num_threads);
    return 0;
}
