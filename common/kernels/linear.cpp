// The projection kernel of linear.h, exported for `--cpu-linear native` (common/models/linear.py
// packs the weights and calls it; common/kernels/__init__.py builds and loads it).
#include "linear.h"

extern "C" void pdc_linear(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wb, int64_t N,
                           const float* bias, float* y, int64_t ldy, int num_threads) {
    pdc::linear::run(x, M, K, ldx, wb, N, bias, y, ldy, num_threads);
}
