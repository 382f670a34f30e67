// nanochat's AdamW step as libtorch's fused kernel (`at::_fused_adamw_`, what
// torch.optim.AdamW(fused=True) runs): one kernel reads parameter, gradient and both moments
// once and writes them once, where the same step in separate tensor ops makes ~24 passes over
// memory. tch does not bind it (an in-place op over tensor lists with no return value), so this
// shim does; see src/fused_adamw.rs. The update is nanochat's: p *= 1 - lr*wd; m = lerp(m, g,
// 1-b1); v = b2*v + (1-b2)*g^2; p -= lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps).
//
// Tensors arrive as tch's handles (`torch::Tensor*`). Every C++ exception is caught: nothing
// unwinds across the FFI boundary.
#include <cstddef>
#include <cstring>
#include <exception>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>

#include "ffi_error.h"

namespace {

std::vector<at::Tensor> list(const void* const* handles, size_t n) {
    std::vector<at::Tensor> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        out.push_back(*static_cast<const at::Tensor*>(handles[i]));
    }
    return out;
}

}  // namespace

extern "C" int trainyard_fused_adamw(const void* const* params, const void* const* grads,
                                     const void* const* exp_avgs, const void* const* exp_avg_sqs,
                                     const void* const* steps, size_t n, double lr, double beta1,
                                     double beta2, double weight_decay, double eps, char* error,
                                     size_t error_len) {
    try {
        at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n),
                          {}, list(steps, n), lr, beta1, beta2, weight_decay, eps,
                          /*amsgrad=*/false, /*maximize=*/false);
        return 0;
    } catch (const std::exception& e) {
        return trainyard_ffi_error(e, error, error_len);
    }
}
