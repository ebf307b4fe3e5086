#!/usr/bin/env bash
# ReCycle on GPUs (issue 40): every check of the NCCL failure path, one line each, in at most 8 minutes
# on one GPU.
#   bash scripts/gpu_check.sh            on a machine with a CUDA device and torch (2.11 or later)
#   bash scripts/gpu_check.sh NAME...    only these checks (nccl_abort, parity, failures)
# It installs what the machine lacks from the wheels in .whl/ (DeepSpeed, pydantic, hjson, ...; built
# on another machine: `pip wheel --no-deps deepspeed==0.19.8` and `pip download` of the others) into
# a folder of its own, never into the machine's Python. Logs go to $GPU_CHECK_LOGS (default: $OUT
# where set, else /tmp/gpu_check). Lines:
#   - the machine: GPU, torch, CUDA and NCCL versions;
#   - parity: ReCycle's engine against stock DeepSpeed on CUDA with NCCL, bitwise (fp32);
#   - the abort path: a peer SIGKILLed or SIGSTOPped while survivors sit in an NCCL all-reduce and a
#     recv, and what each communicator operation costs (ds_recycle.testing.nccl_abort);
#   - a ds-recycle launch --backend nccl job: a rank SIGKILLed, one SIGSTOPped, both re-joined,
#     fault-free parameters.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOGS=${GPU_CHECK_LOGS:-${OUT:-/tmp/gpu_check}}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DS_ACCELERATOR

if ! "$PYTHON" -c "import deepspeed" >/dev/null 2>&1; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    site=/tmp/ds_recycle_site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
      >"$LOGS/pip.log" 2>&1 || { echo "gpu check: FAILED installing the wheels of .whl/ (pip.log)"; exit 1; }
    export PYTHONPATH="$PYTHONPATH:$site"
  else
    echo "gpu check: FAILED: DeepSpeed is not importable and .whl/ holds no wheels to install"
    exit 1
  fi
fi

"$PYTHON" - <<'EOF'
import torch
if not torch.cuda.is_available():
    print("gpu check: skipped: torch sees no CUDA device")
    raise SystemExit(3)
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(
    f"gpu check: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
    f"CUDA {torch.version.cuda}, NCCL {nccl}"
)
EOF
case $? in
  0) ;;
  3) exit 0 ;;
  *) echo "gpu check: FAILED: torch could not be asked about CUDA"; exit 1 ;;
esac

status=0
# check NAME BOUND COMMAND...: run it with a time bound; its log in $LOGS/NAME.log; one line.
check() {
  local name=$1 bound=$2 began code
  shift 2
  began=$(date +%s.%N)
  timeout --signal=TERM --kill-after=10 "$bound" "$@" >"$LOGS/$name.log" 2>&1
  code=$?
  local took
  took=$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')
  grep -h '^\(nccl\|gpu\)' "$LOGS/$name.log" | sed "s/^/  /"
  if [ "$code" -eq 0 ]; then
    echo "gpu check: $name: PASSED (${took} s)"
  else
    status=1
    [ "$code" -eq 124 ] && code="timed out after $bound s"
    echo "gpu check: $name: FAILED ($code, ${took} s; last lines of $name.log:)"
    tail -n 25 "$LOGS/$name.log" | sed "s/^/    /"
  fi
}

# the rank logs of each check's jobs stay under $LOGS/pytest_NAME (a failed check's tail is printed above)
pytest=("$PYTHON" -m pytest -q -s -rs -p no:cacheprovider --timeout 240)
selected=" $* "
run_check() {  # run_check NAME BOUND COMMAND...: when NAME was asked for (or nothing was)
  if [ "$selected" = "  " ] || [[ "$selected" == *" $1 "* ]]; then check "$@"; fi
}
run_check nccl_abort 130 "$PYTHON" -m ds_recycle.testing.nccl_abort --budget 110 --json "$LOGS/nccl_abort.json"
run_check parity 120 "${pytest[@]}" --basetemp "$LOGS/pytest_parity" tests/engine/test_gpu_parity.py
run_check failures 240 "${pytest[@]}" --basetemp "$LOGS/pytest_failures" tests/runtime/test_gpu_failures.py
exit $status
