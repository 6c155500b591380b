// The decode-attention kernel of attention.h, exported for the torch attention backend's decode
// step over the mirror (common/kernels/__init__.py builds and loads it; plain C ABI).
#include "attention.h"

// q and out in lane order (lane b is row b); lens [batch] in lane order; blocked: the keys' layout.
// scratch: see attention.h.
extern "C" void pdc_decode_attention(const float* q, const float* k, const float* v, float* out,
                                     const int32_t* lens, float* scratch, int64_t batch, int64_t heads,
                                     int64_t kv_heads, int64_t dim, int64_t s_cap, int64_t blocked,
                                     int64_t k_lane_stride, int64_t v_lane_stride, float scale, int num_threads) {
    pdc::attention::run(q, k, v, out, nullptr, lens, scratch, batch, heads, kv_heads, dim, s_cap, blocked != 0,
                        k_lane_stride, v_lane_stride, scale, num_threads);
}
