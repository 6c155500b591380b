// The vector type and its few helpers every kernel here shares: one AVX-512 register of floats
// (the compiler splits it in two AVX2 registers where the CPU has no AVX-512).
#pragma once
#include <cstdint>

namespace pdc {

constexpr int VW = 16;  // floats per vector
typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t)), aligned(sizeof(int32_t))));

inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
// All lanes x. Not `vf{} + x`: that is a scalar add (0 + -0 is +0, so it cannot be skipped) and a
// register broadcast, two floating-point uops where a broadcast from memory is one load.
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline float hsum(vf x) {
    float s = 0.0f;
    for (int j = 0; j < VW; j++) s += x[j];
    return s;
}

// Horizontal max and sum in four halving steps of whole-vector shuffles (the sum's order is a tree,
// not hsum's left to right): a lane at a time cost ~30 scalar instructions per row and key block in
// the prefill kernel's softmax, a third of its scores' FMAs.
inline vf swap_halves(vf x, int width) {
    switch (width) {
        case 8: return __builtin_shuffle(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
        case 4: return __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
        case 2: return __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
        default: return __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    }
}

inline float hmax_tree(vf x) {
    for (int w = 8; w >= 1; w /= 2) {
        vf y = swap_halves(x, w);
        x = x > y ? x : y;
    }
    return x[0];
}

inline float hsum_tree(vf x) {
    for (int w = 8; w >= 1; w /= 2) x += swap_halves(x, w);
    return x[0];
}

// e^x for x <= 0 (0 below -87, where float32's e^x is subnormal): Cephes' expf, within 2 ulp of
// expf over x <= 0.
inline vf exp_nonpos(vf x) {
    const vf lo = splat(-87.0f);
    vf xc = x < lo ? lo : x;
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    vf n = (xc * 1.44269504088896341f + magic) - magic;
    vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vf z = r * r;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    vf e = p * (vf)two_n;  // a vector cast reinterprets the bits
    return x < lo ? splat(0.0f) : e;
}

inline float exp_nonpos(float x) {
    vf e = exp_nonpos(splat(x));
    return e[0];
}

}  // namespace pdc
