#!/usr/bin/env bash
# Install robot-llm with its model stack into a virtual environment (default: .venv).
#
#   bash scripts/install.sh [--dev] [--deepspeed-ops] [--system-deps]
#
#   --dev            also the test tools (pytest, ruff, playwright, ...): the test command uses it.
#   --deepspeed-ops  compile DeepSpeed's C++ ops (async_io for NVMe offload, shm_comm) now,
#                    4 to 13 minutes on 2 cores. Without it DeepSpeed compiles the ops it needs
#                    the first time the deepspeed backend runs (robot-llm logs that it does, and
#                    how long it took). The stream and memory backends never need them.
#   --system-deps    install missing Debian packages (libaio-dev, for NVMe offload) with apt-get.
#                    Without it nothing outside the virtual environment is touched.
#
# The order is load-bearing (see README, "Installing"):
#   1. torch is pinned and installed first, so pip never resolves a multi-GB CUDA build;
#   2. DeepSpeed is built against that torch;
#   3. robot-llm itself, editable, with the model, report and demo extras (and dev with --dev);
#      demo is the demo's real model, Gemma 3 270M (Gemma Terms of Use), about 240 MB.
set -euo pipefail

ops=0
system_deps=0
extras="model,report,demo"
for arg in "$@"; do
    case "$arg" in
        --dev) extras="$extras,dev" ;;
        --deepspeed-ops) ops=1 ;;
        --system-deps) system_deps=1 ;;
        -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    esac
done

VENV="${VENV:-.venv}"
cd "$(dirname "$0")/.."

aio=1
if [ ! -e /usr/include/libaio.h ]; then
    if [ "$system_deps" = 1 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
    else
        aio=0
        echo "hint: libaio-dev is not installed, so DeepSpeed's NVMe offload will not work" \
            "(apt-get install -y libaio-dev, or rerun with --system-deps)" >&2
    fi
fi

python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"  # absolute from here on (PATH below)
"$VENV/bin/pip" install --quiet torch==2.13.0 ninja wheel

ops_built() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import sys
from deepspeed.git_version_info import installed_ops
sys.exit(0 if installed_ops.get("deepspeed_shm_comm") else 1)
PY
}

if [ "$ops" = 1 ]; then
    # --no-build-isolation: the op prebuild imports the torch installed above.
    # --no-cache-dir: otherwise pip may reuse a cached pure-Python DeepSpeed wheel and skip the ops.
    # --force-reinstall: a DeepSpeed installed earlier without its ops is rebuilt with them.
    # LDFLAGS: DeepSpeed 0.19.8's CPU ahead-of-time build drops async_io's own -laio.
    reinstall=()
    if "$VENV/bin/python" -c "import deepspeed" 2>/dev/null && ! ops_built; then
        reinstall=(--force-reinstall --no-deps)
    fi
    aio_ldflags=""
    [ "$aio" = 1 ] && aio_ldflags="-Wl,--no-as-needed -laio"
    echo "compiling DeepSpeed's ops (4 to 13 minutes on 2 cores)" >&2
    PATH="$VENV/bin:$PATH" LDFLAGS="$aio_ldflags" DS_BUILD_AIO="$aio" DS_BUILD_SHM_COMM=1 \
        DS_ENABLE_NINJA=1 MAX_JOBS=2 \
        "$VENV/bin/pip" install --quiet --no-build-isolation --no-cache-dir "${reinstall[@]}" deepspeed==0.19.8
else
    # Python only: the ops it needs are compiled on first use of the deepspeed backend.
    PATH="$VENV/bin:$PATH" DS_BUILD_OPS=0 "$VENV/bin/pip" install --quiet --no-build-isolation deepspeed==0.19.8
fi
"$VENV/bin/pip" install --quiet -e ".[$extras]"
echo "robot-llm installed in $VENV"
