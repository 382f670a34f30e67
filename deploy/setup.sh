#!/usr/bin/env bash
# Prepares this checkout: checks the tools, builds every binary of the workspace.
# Idempotent: run it as often as you like; cargo only rebuilds what changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "setup: $1 is not installed. $2" >&2
        exit 1
    fi
}
need cargo "Install the Rust toolchain (https://rustup.rs), then run this script again."
need python3 "Install Python 3 (e.g. apt-get install python3); the example rank program needs it."

# Disk: a fresh checkout's setup and test run grow target/ and .venv to about ROOM_GIB in all
# (a fresh clone measured 2.9 GiB and 4.7 GiB at their largest, with the incremental caches off
# as deploy/test.sh builds; the apt packages come on top). A linker that runs out of disk
# dies with "Bus error", far from the cause, so say it here first.
ROOM_GIB=9
if ! disk="$(bash deploy/disk.sh --room "$ROOM_GIB")"; then
    echo "setup: warning: too little disk for a full build here ($disk); target/ and .venv" \
        "grow to about $ROOM_GIB GiB in all. Free some space, or the build may fail (a linker" \
        "out of disk dies with 'Bus error')." >&2
else
    echo "setup: disk: $disk"
fi

# PostgreSQL's server binaries: the store suite, the end-to-end tests on PostgreSQL and the
# PostgreSQL benches start throwaway servers of their own (testkit/src/pg_server.rs).
# A controller pointed at an existing PostgreSQL needs none of this.
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && ! command -v initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing PostgreSQL (apt-get install postgresql) for the store tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "setup: PostgreSQL's server is not installed; the tests start their own (as root: apt-get install postgresql)" >&2
        exit 1
    fi
fi

# Headless Chromium: the web view's tests load its pages (controller/web/) with
# `chromium --headless --dump-dom` and read what the page's script rendered. fonts-dejavu-core
# gives it a font to lay pages out (and take screenshots) with on a bare server. Running the
# controller needs none of this: browsers are the operators'.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Chromium (apt-get install chromium fonts-dejavu-core) for the web view tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
    else
        echo "setup: chromium is not installed; the web view tests need it (as root: apt-get install chromium fonts-dejavu-core)" >&2
        exit 1
    fi
fi

# iproute2 and curl: the tests that put the controller's HTTP listener on a non-loopback address
# run it in a network namespace of their own (`ip netns`) and talk to it with curl
# (tests/tests/http_exposure.rs), and the failure tests run hosts in namespaces of their own on a
# test bridge (tests/src/netlab.rs, tests/tests/hosts_apart.rs). Without root they are skipped,
# and so is this.
if ! command -v ip >/dev/null 2>&1 || ! command -v curl >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing iproute2 and curl (apt-get) for the network tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 curl >/dev/null
    else
        echo "setup: ip (iproute2) or curl is missing; the network tests will say skipped" >&2
    fi
fi

# Slurm and munge: the Slurm tests (tests/tests/slurm.rs, tests/src/slurm.rs) start a real
# cluster of their own (munged, slurmctld, one slurmd per network-namespace host) from Debian's
# packages, configured by the test; nothing is started here, and the packages' own services stay
# off. Running trainyard on a Slurm cluster needs only Slurm's client commands on the login node
# (docs/slurm.md).
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
    || ! command -v sbatch >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Slurm and munge (apt-get install slurmctld slurmd slurm-client munge) for the Slurm tests"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null
    else
        echo "setup: Slurm is not installed; the Slurm tests will say skipped (as root: apt-get install slurmctld slurmd slurm-client munge)" >&2
    fi
fi

# The built-in engine links libtorch from the PyPI torch==2.11.0 wheel (the version tch 0.24
# is built against), installed into the virtual environment .venv of this checkout. The wheel
# pulls the nvidia-* CUDA libraries (a few GB) that the GPU path needs. .cargo/config.toml points
# torch-sys at .venv/libtorch, a link to the wheel's torch package made here, so plain cargo
# commands find libtorch with no exports.
TORCH_VERSION=2.11.0
VENV="$ROOT/.venv"
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
    if ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "setup: installing python3-venv (apt-get)"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
        else
            echo "setup: python3 -m venv is not available; install python3-venv (as root: apt-get install python3-venv)" >&2
            exit 1
        fi
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        echo "setup: creating the virtual environment $VENV"
        python3 -m venv "$VENV"
    fi
    echo "setup: installing torch==$TORCH_VERSION into $VENV (a few GB with its CUDA libraries)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch==$TORCH_VERSION" numpy
fi
# PyTorch Lightning, for the end-to-end test that runs a Lightning DDP script as a job
# (tests/tests/real_scripts.rs); torchrun comes with torch.
LIGHTNING_VERSION=2.6.6
if ! "$VENV/bin/python" -c "import sys, lightning; sys.exit(lightning.__version__ != '$LIGHTNING_VERSION')" >/dev/null 2>&1; then
    echo "setup: installing lightning==$LIGHTNING_VERSION into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "lightning==$LIGHTNING_VERSION" "torch==$TORCH_VERSION"
fi
# Third-party trainers and loggers, for the tests that run unchanged scripts under trainyard's
# bootstrap (tests/tests/unchanged_scripts.rs): wandb (offline), MLflow (mlflow-skinny, a local
# file store), TensorBoard, and Hugging Face transformers' Trainer (with accelerate). Pinned,
# so a new release upstream cannot change what the suite tests; checked by version, so a second
# run of setup installs nothing.
THIRD_PARTY=(wandb==0.31.0 mlflow-skinny==3.17.2 tensorboard==2.21.0 transformers==5.24.0 accelerate==1.15.0)
if ! "$VENV/bin/python" - "${THIRD_PARTY[@]}" >/dev/null 2>&1 <<'PY'
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))
PY
then
    echo "setup: installing ${THIRD_PARTY[*]} into $VENV (trainers and loggers the tests run unchanged)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "${THIRD_PARTY[@]}" "torch==$TORCH_VERSION"
fi
# trainyard's receipt helper for PyTorch scripts (python/), installed from the checkout the way
# users install it; reinstalled every time so the venv never holds a stale copy.
echo "setup: installing trainyard-receipts from python/ into $VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$ROOT/python"
TORCH_DIR="$("$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
ln -sfnr "$TORCH_DIR" "$VENV/libtorch"
# cudarc looks for libnccl.so, not the wheel's libnccl.so.2: a link to the same file, in a
# directory the engine's rpath names, so that cudarc and libtorch share one NCCL.
mkdir -p "$VENV/nccl-lib"
NCCL_SO="$(dirname "$TORCH_DIR")/nvidia/nccl/lib/libnccl.so.2"
if [ -e "$NCCL_SO" ]; then
    ln -sfnr "$NCCL_SO" "$VENV/nccl-lib/libnccl.so"
fi
# Likewise NVRTC (the engine compiles its own CUDA kernels at run time): cudarc looks for
# libnvrtc.so, the wheel ships libnvrtc.so.13 (the engine loads NVRTC's builtins from the
# link's real directory itself, see engine/src/kernels.rs).
NVRTC_SO="$(ls "$(dirname "$TORCH_DIR")"/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -n 1 || true)"
if [ -n "$NVRTC_SO" ]; then
    ln -sfnr "$NVRTC_SO" "$VENV/nccl-lib/libnvrtc.so"
fi

echo "setup: building the workspace binaries (cargo build --workspace --bins)"
cargo build --workspace --bins

echo "setup: done; binaries are in $ROOT/target/debug"
