// CUDA caching-allocator statistics for the step receipt (tch 0.24 exposes none).
//
// Compiled by engine/build.rs with the `cc` crate (C++17) against the torch wheel's headers and
// linked against the wheel's libc10 (and libc10_cuda, whose static initialiser registers the CUDA
// allocator). Read by engine/src/gpu_memory.rs.
//
// Which API: c10::cuda::CUDACachingAllocator::getDeviceStats(d) / resetPeakStats(d) are inline
// wrappers for `get()->getDeviceStats(d)` / `get()->resetPeakStats(d)`, virtuals of
// c10::DeviceAllocator that the CUDAAllocator overrides. Their header
// (c10/cuda/CUDACachingAllocator.h) includes cuda_runtime.h, which needs the CUDA toolkit's
// crt/host_config.h: the wheel's nvidia-cuda-runtime package ships cuda_runtime.h without it, so
// that header does not compile on a machine that only has the wheel (CI, this repo's setup). The
// same allocator object is reachable through the device-generic header
// c10/core/CachingDeviceAllocator.h: libc10_cuda registers it with
// c10::SetAllocator(kCUDA, allocator) when it stores it in CUDACachingAllocator::allocator, and
// c10::getDeviceAllocator(kCUDA) returns it (torch.accelerator.memory_stats goes this way;
// checked for the 2.11 wheel: BackendStaticInitializer's constructor in libc10_cuda.so passes
// one pointer to both). So we call the same virtuals on the same object, with no CUDA header.
//
// No C++ exception crosses the FFI boundary: every entry point is noexcept and catches
// everything, returning an error code. Before touching the allocator each function asks the CUDA
// device-guard implementation for the device count (noexcept; 0 without a driver) and returns
// TRAINYARD_MEM_NO_DEVICE when the index is not a device, so calling it on a CPU-only host is
// safe. The Rust wrapper additionally only calls it when libtorch reports CUDA.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

extern "C" {

// Mirrored by `RawStats` in engine/src/gpu_memory.rs (repr(C)); bytes, aggregate pool.
struct TrainyardMemStats {
  int64_t allocated_bytes;
  int64_t reserved_bytes;
  int64_t peak_allocated_bytes;
  int64_t peak_reserved_bytes;
};

// Return codes; mirrored in engine/src/gpu_memory.rs.
enum {
  TRAINYARD_MEM_OK = 0,
  TRAINYARD_MEM_NO_CUDA = 1,          // libtorch has no CUDA backend registered
  TRAINYARD_MEM_NO_DEVICE = 2,        // no CUDA device, or index out of range
  TRAINYARD_MEM_NOT_INITIALIZED = 3,  // allocator not initialised yet (CUDA never used)
  TRAINYARD_MEM_ERROR = 4,            // c10 threw (message in err_buf)
  TRAINYARD_MEM_BAD_ARG = 5,          // null output pointer
};

}  // extern "C"

namespace {

void copy_msg(const char* msg, char* buf, size_t len) noexcept {
  if (buf == nullptr || len == 0) {
    return;
  }
  if (msg == nullptr) {
    msg = "";
  }
  size_t n = std::strlen(msg);
  if (n >= len) {
    n = len - 1;
  }
  std::memcpy(buf, msg, n);
  buf[n] = '\0';
}

// The CUDA allocator for `device`, or a return code. May throw c10::Error.
int cuda_allocator(int device, c10::DeviceAllocator** out) {
  *out = nullptr;
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    return TRAINYARD_MEM_NO_CUDA;
  }
  const int count =
      static_cast<int>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount());
  if (device < 0 || device >= count) {
    return TRAINYARD_MEM_NO_DEVICE;
  }
  c10::DeviceAllocator* alloc = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  if (!alloc->initialized()) {
    return TRAINYARD_MEM_NOT_INITIALIZED;
  }
  *out = alloc;
  return TRAINYARD_MEM_OK;
}

}  // namespace

extern "C" {

int trainyard_cuda_memory_stats(int device, TrainyardMemStats* out, char* err_buf,
                                size_t err_len) noexcept {
  copy_msg("", err_buf, err_len);
  if (out == nullptr) {
    return TRAINYARD_MEM_BAD_ARG;
  }
  std::memset(out, 0, sizeof(*out));
  try {
    c10::DeviceAllocator* alloc = nullptr;
    const int rc = cuda_allocator(device, &alloc);
    if (rc != TRAINYARD_MEM_OK) {
      return rc;
    }
    const auto stats = alloc->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_bytes = stats.allocated_bytes[agg].current;
    out->reserved_bytes = stats.reserved_bytes[agg].current;
    out->peak_allocated_bytes = stats.allocated_bytes[agg].peak;
    out->peak_reserved_bytes = stats.reserved_bytes[agg].peak;
    return TRAINYARD_MEM_OK;
  } catch (const std::exception& e) {
    copy_msg(e.what(), err_buf, err_len);
    return TRAINYARD_MEM_ERROR;
  } catch (...) {
    copy_msg("unknown C++ exception", err_buf, err_len);
    return TRAINYARD_MEM_ERROR;
  }
}

int trainyard_cuda_memory_reset_peak(int device, char* err_buf, size_t err_len) noexcept {
  copy_msg("", err_buf, err_len);
  try {
    c10::DeviceAllocator* alloc = nullptr;
    const int rc = cuda_allocator(device, &alloc);
    if (rc != TRAINYARD_MEM_OK) {
      return rc;
    }
    alloc->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return TRAINYARD_MEM_OK;
  } catch (const std::exception& e) {
    copy_msg(e.what(), err_buf, err_len);
    return TRAINYARD_MEM_ERROR;
  } catch (...) {
    copy_msg("unknown C++ exception", err_buf, err_len);
    return TRAINYARD_MEM_ERROR;
  }
}

}  // extern "C"
