// The error side of the engine's FFI shims: a caught C++ exception's message copied into the
// caller's buffer (truncated, always NUL-terminated), and the shims' failure code.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>

inline int trainyard_ffi_error(const std::exception& e, char* error, size_t error_len) {
    if (error != nullptr && error_len > 0) {
        std::strncpy(error, e.what(), error_len - 1);
        error[error_len - 1] = '\0';
    }
    return 1;
}
