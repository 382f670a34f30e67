// Custom autograd ops whose forward and backward are the engine's own (Rust, launching NVRTC
// kernels): tch has no custom autograd Function, so this shim defines one libtorch Function,
// `RustOp`, that calls back into the engine for both passes. See src/custom_op.rs.
//
// The protocol: `trainyard_custom_op` applies op `op` to `n_in` tensors. The forward callback
// returns the op's `n_out` outputs followed by `n_extra` tensors to keep for the backward. The
// backward callback receives the inputs, then the extras, then the `n_out` output gradients,
// and returns one gradient per input (a null handle where the input needs none). Handles passed
// to a callback are borrowed (tch shallow-clones them); handles returned are new `at::Tensor*`
// whose ownership passes to the side that receives them. Every C++ exception is caught at the
// entry point; a callback's error is thrown as a C++ exception into libtorch (the autograd
// engine carries it to whoever called backward).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "ffi_error.h"

extern "C" {
typedef int (*trainyard_op_callback)(int64_t op, int backward, const void* const* tensors,
                                     size_t n_tensors, void** outputs, size_t n_outputs,
                                     char* error, size_t error_len);
}

namespace {
std::atomic<trainyard_op_callback> callback{nullptr};

std::vector<at::Tensor> call(int64_t op, int backward, const std::vector<at::Tensor>& tensors,
                             size_t n_outputs, bool allow_undefined) {
    trainyard_op_callback f = callback.load();
    if (f == nullptr) {
        throw std::runtime_error("trainyard custom op: no callback registered");
    }
    std::vector<const void*> in;
    in.reserve(tensors.size());
    for (const auto& t : tensors) {
        in.push_back(&t);
    }
    std::vector<void*> out(n_outputs, nullptr);
    char error[512] = {0};
    const int rc = f(op, backward, in.data(), in.size(), out.data(), out.size(), error, sizeof error);
    std::vector<at::Tensor> result;
    result.reserve(n_outputs);
    for (void* p : out) {
        if (p == nullptr) {
            result.emplace_back();
            continue;
        }
        auto* h = static_cast<at::Tensor*>(p);
        result.push_back(*h);
        delete h;
    }
    if (rc != 0) {
        throw std::runtime_error(std::string("trainyard custom op ") + std::to_string(op) +
                                 (backward != 0 ? " backward: " : " forward: ") + error);
    }
    if (!allow_undefined) {
        for (const auto& t : result) {
            if (!t.defined()) {
                throw std::runtime_error("trainyard custom op " + std::to_string(op) +
                                         ": the forward returned an undefined tensor");
            }
        }
    }
    return result;
}

struct RustOp : public torch::autograd::Function<RustOp> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                  at::TensorList inputs, int64_t op,
                                                  int64_t n_out, int64_t n_extra) {
        std::vector<at::Tensor> in(inputs.begin(), inputs.end());
        auto all = call(op, 0, in, static_cast<size_t>(n_out + n_extra), false);
        std::vector<at::Tensor> outputs(all.begin(), all.begin() + n_out);
        std::vector<at::Tensor> saved = in;
        saved.insert(saved.end(), all.begin() + n_out, all.end());
        ctx->save_for_backward(saved);
        ctx->saved_data["op"] = op;
        ctx->saved_data["n_in"] = static_cast<int64_t>(in.size());
        return outputs;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        const int64_t op = ctx->saved_data["op"].toInt();
        const auto n_in = static_cast<size_t>(ctx->saved_data["n_in"].toInt());
        std::vector<at::Tensor> tensors = ctx->get_saved_variables();
        tensors.insert(tensors.end(), grads.begin(), grads.end());
        auto result = call(op, 1, tensors, n_in, true);
        // No gradients for op, n_out and n_extra.
        result.emplace_back();
        result.emplace_back();
        result.emplace_back();
        return result;
    }
};
}  // namespace

extern "C" void trainyard_custom_op_register(trainyard_op_callback f) { callback.store(f); }

extern "C" int trainyard_custom_op(int64_t op, const void* const* inputs, size_t n_in,
                                   int64_t n_out, int64_t n_extra, void** outputs, char* error,
                                   size_t error_len) {
    try {
        std::vector<at::Tensor> in;
        in.reserve(n_in);
        for (size_t i = 0; i < n_in; ++i) {
            in.push_back(*static_cast<const at::Tensor*>(inputs[i]));
        }
        auto out = RustOp::apply(at::TensorList(in), op, n_out, n_extra);
        for (size_t i = 0; i < out.size(); ++i) {
            outputs[i] = new at::Tensor(out[i]);
        }
        return 0;
    } catch (const std::exception& e) {
        return trainyard_ffi_error(e, error, error_len);
    }
}
