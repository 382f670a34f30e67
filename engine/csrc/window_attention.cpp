// Causal attention over a sliding window through libtorch's FlashAttention kernel
// (`at::_flash_attention_forward` with `window_size_left`), which tch does not bind: nanochat's
// short-window layers. Called through the dispatcher, so autograd records it and its backward
// is libtorch's `_flash_attention_backward` with the same window. Inputs are (B, T, H, D) bf16
// or fp16 on a GPU; the output has the same layout. See src/attention.rs.
//
// Tensors arrive as tch's handles (`torch::Tensor*`); the result is a new handle that tch owns.
// Every C++ exception is caught: nothing unwinds across the FFI boundary.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward.h>

#include "ffi_error.h"

extern "C" int trainyard_window_attention(const void* q, const void* k, const void* v,
                                          int64_t window_left, void** out, char* error,
                                          size_t error_len) {
    try {
        const at::Tensor& query = *static_cast<const at::Tensor*>(q);
        const at::Tensor& key = *static_cast<const at::Tensor*>(k);
        const at::Tensor& value = *static_cast<const at::Tensor*>(v);
        const int64_t t = query.size(1);
        auto result = at::_flash_attention_forward(query, key, value, std::nullopt, std::nullopt,
                                                   t, key.size(1), /*dropout_p=*/0.0,
                                                   /*is_causal=*/true, /*return_debug_mask=*/false,
                                                   /*scale=*/std::nullopt, window_left,
                                                   /*window_size_right=*/int64_t{0});
        *out = new at::Tensor(std::get<0>(result));
        return 0;
    } catch (const std::exception& e) {
        return trainyard_ffi_error(e, error, error_len);
    }
}
