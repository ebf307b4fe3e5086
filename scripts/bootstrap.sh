#!/usr/bin/env bash
# Create (or reuse) .venv and install ds_recycle with its test and hf extras.
# torch==2.13.0 goes first: it is the CPU wheel here, and installing it first keeps the
# `torch>=2.13` requirement of deepspeed and ds_recycle from pulling a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

# The status page's browser test (tests/runtime/test_status_page.py) needs a headless Chromium. When
# none is found, Debian's chromium is installed here, as root on a Debian-like machine (CI). Without
# root or apt-get the bootstrap says so and goes on: the test then skips (fails under CI=true).
BROWSERS=(chromium chromium-browser google-chrome google-chrome-stable)  # the test's list
have_browser() {
  local name
  for name in "${BROWSERS[@]}"; do
    if command -v "$name" >/dev/null 2>&1; then return 0; fi
  done
  return 1
}
if ! have_browser; then
  if [ "$(id -u)" -eq 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: no headless browser (${BROWSERS[*]}); installing Debian's chromium with apt-get"
    apt_log="$(mktemp)"
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
      >"$apt_log" 2>&1 && have_browser; then
      echo "bootstrap: installed $(chromium --version 2>/dev/null || echo chromium)"
    else
      tail -n 20 "$apt_log"
      echo "bootstrap: WARNING: could not install chromium (apt-get output above); the status page's browser test will skip (and fail under CI=true)"
    fi
    rm -f "$apt_log"
  else
    echo "bootstrap: no headless browser (${BROWSERS[*]}) and no root apt-get to install one: the status page's browser test will skip (and fail under CI=true); to run it: sudo apt-get install chromium"
  fi
fi

# The etcd backend's tests start a 3-member etcd cluster (tests/runtime/test_etcd*.py) and the Slurm
# tests a Slurm cluster of their own (tests/slurm): Debian's etcd-server, slurm-wlm and munge, installed
# here as root on a Debian-like machine when missing. Without them those tests skip (fail under CI=true).
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)        # the Slurm nodes' network namespaces
command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)  # ...entered with nsenter and unshare
command -v openssl >/dev/null 2>&1 || missing+=(openssl)     # the etcd TLS test's certificates
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${missing[*]} with apt-get (the etcd and Slurm tests' clusters)"
    apt_log="$(mktemp)"
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}"; } >"$apt_log" 2>&1; then
      tail -n 20 "$apt_log"
      echo "bootstrap: WARNING: could not install ${missing[*]}: the etcd and Slurm tests will skip (and fail under CI=true)"
    fi
    rm -f "$apt_log"
  else
    echo "bootstrap: ${missing[*]} missing and no root apt-get: the etcd and Slurm tests will skip (fail under CI=true)"
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[test,hf]"
# DeepSpeed builds its CPU shared-memory comm op on the first engine start. Build it here, once, in a
# cache of this venv's own (scripts/test.sh uses the same): a rank killed mid-build (a failure test)
# leaves the build's lock behind, and every later rank that shares the cache waits on it forever.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
