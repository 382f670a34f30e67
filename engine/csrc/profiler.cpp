// libtorch's Kineto profiler from the engine (tch does not bind it): `--profile-steps` records
// the CPU ops and, on a GPU, every CUDA kernel and copy of the steps asked for, and writes them
// as a Chrome trace (the format `torch.profiler` exports; chrome://tracing and Perfetto read it).
// See src/profiler.rs. Every C++ exception is caught: nothing unwinds across the FFI boundary.
#include <cstddef>
#include <exception>
#include <set>
#include <stdexcept>
#include <string>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "ffi_error.h"

namespace {
std::set<torch::profiler::impl::ActivityType> activities(int cuda) {
    std::set<torch::profiler::impl::ActivityType> a{torch::profiler::impl::ActivityType::CPU};
    if (cuda != 0) {
        a.insert(torch::profiler::impl::ActivityType::CUDA);
    }
    return a;
}

torch::profiler::impl::ProfilerConfig config() {
    return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO,
                                                 /*report_input_shapes=*/true);
}
}  // namespace

extern "C" int trainyard_profiler_start(int cuda, char* error, size_t error_len) {
    try {
        torch::autograd::profiler::prepareProfiler(config(), activities(cuda));
        torch::autograd::profiler::enableProfiler(config(), activities(cuda));
        return 0;
    } catch (const std::exception& e) {
        return trainyard_ffi_error(e, error, error_len);
    }
}

extern "C" int trainyard_profiler_stop(const char* path, char* error, size_t error_len) {
    try {
        auto result = torch::autograd::profiler::disableProfiler();
        if (!result) {
            throw std::runtime_error("the profiler was not running");
        }
        result->save(std::string(path));
        return 0;
    } catch (const std::exception& e) {
        return trainyard_ffi_error(e, error, error_len);
    }
}
