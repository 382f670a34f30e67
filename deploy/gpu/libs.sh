# Sourced by the GPU scripts: the libraries a GPU node's python torch wheel carries, where the
# binaries find them. libtorch comes from the wheel's torch package (the engine's rpath names the
# build machine's .venv, which a GPU node need not have); cudarc looks for `libnccl.so` and
# `libnvrtc.so`, the wheel ships `libnccl.so.2` and `libnvrtc.so.13`, so a private directory
# ($GPU_LIBS, removed by the caller) holds links under the names cudarc asks for.
# Sets TORCH_DIR, GPU_LIBS, LD_LIBRARY_PATH and TRAINYARD_NCCL_LIBRARY; needs $PY.
TORCH_DIR="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || {
    echo "$0: $PY cannot import torch; set PYTHON to a python with torch" >&2
    exit 1
}
GPU_LIBS="$(mktemp -d)"
NVIDIA_WHEELS="$(dirname "$TORCH_DIR")/nvidia"
[[ -e "$NVIDIA_WHEELS/nccl/lib/libnccl.so.2" ]] && ln -sf "$NVIDIA_WHEELS/nccl/lib/libnccl.so.2" "$GPU_LIBS/libnccl.so"
NVRTC_SO="$(ls "$NVIDIA_WHEELS"/cu*/lib/libnvrtc.so.* 2>/dev/null | head -n 1 || true)"
[[ -n "$NVRTC_SO" ]] && ln -sf "$NVRTC_SO" "$GPU_LIBS/libnvrtc.so"
export LD_LIBRARY_PATH="$TORCH_DIR/lib:$GPU_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TRAINYARD_NCCL_LIBRARY="$NVIDIA_WHEELS/nccl/lib/libnccl.so.2"
