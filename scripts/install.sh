#!/usr/bin/env bash
# Install robot-llm with its model stack into a virtual environment (default: .venv).
#
# The order is load-bearing (see README, "Installing"):
#   1. torch is pinned and installed first, so pip never resolves a multi-GB CUDA build;
#   2. DeepSpeed is built against that torch with its CPU ops (async_io for NVMe offload,
#      shm_comm) compiled now rather than JIT-compiled, for minutes, on first use;
#   3. robot-llm itself, editable, with the model and dev extras.
# NVMe offload needs Debian's libaio-dev before step 2: installed here when we are root on a
# Debian-like system; otherwise DeepSpeed is built without async_io (CPU offload still works).
set -euo pipefail

VENV="${VENV:-.venv}"
cd "$(dirname "$0")/.."

aio=1
if [ ! -e /usr/include/libaio.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; } || true
    fi
    if [ ! -e /usr/include/libaio.h ]; then
        aio=0
        echo "libaio-dev is missing: building DeepSpeed without NVMe offload (apt-get install -y libaio-dev, then rerun)" >&2
    fi
fi

python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"  # absolute from here on (PATH below)
"$VENV/bin/pip" install --quiet torch==2.13.0 ninja wheel
# --no-build-isolation: the op prebuild imports the torch installed above.
# --no-cache-dir: otherwise pip may reuse a cached pure-Python DeepSpeed wheel and skip the ops.
# LDFLAGS: DeepSpeed 0.19.8's CPU ahead-of-time build drops async_io's own -laio.
# (A DeepSpeed 0.19.8 already in the venv is kept as it is.)
aio_ldflags=""
[ "$aio" = 1 ] && aio_ldflags="-Wl,--no-as-needed -laio"
PATH="$VENV/bin:$PATH" LDFLAGS="$aio_ldflags" DS_BUILD_AIO="$aio" DS_BUILD_SHM_COMM=1 \
    DS_ENABLE_NINJA=1 MAX_JOBS=2 \
    "$VENV/bin/pip" install --quiet --no-build-isolation --no-cache-dir deepspeed==0.19.8
"$VENV/bin/pip" install --quiet -e ".[model,dev]"
echo "robot-llm installed in $VENV"
