#!/usr/bin/env bash
# A real Slurm cluster on this machine (Debian's slurm-wlm and munge; root): munged, slurmctld and
# three slurmd "nodes" of 2 CPUs, each in network, UTS and mount namespaces of its own
# (ds_recycle/testing/slurm_cluster.py says why and how; tests/slurm runs the README's batch script on it).
#   bash scripts/slurm_cluster.sh start [DIR] [NODES]   start it (DIR default /tmp/ds_recycle_slurm)
#   bash scripts/slurm_cluster.sh shell [DIR]           a shell on the controller's host: sbatch, squeue, scontrol...
#   bash scripts/slurm_cluster.sh stop [DIR]            stop everything it started, by PID; delete its namespaces
# Only the namespaces and processes it made are touched; the host's interfaces are not.
set -euo pipefail
cd "$(dirname "$0")/.."
command=${1:-}
dir=${2:-/tmp/ds_recycle_slurm}
python=.venv/bin/python
case "$command" in
  start)
    exec "$python" -m ds_recycle.testing.slurm_cluster start "$dir" "${3:-3}"
    ;;
  stop)
    exec "$python" -m ds_recycle.testing.slurm_cluster stop "$dir"
    ;;
  shell)
    pid=$("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['pids']['slurmctld'])" "$dir/cluster.json")
    export SLURM_CONF="$dir/slurm.conf" PATH="$PWD/.venv/bin:$PATH" DS_ACCELERATOR=cpu
    echo "SLURM_CONF=$SLURM_CONF; on host ctl (exit to leave)"
    exec nsenter -t "$pid" --net --uts --mount "${SHELL:-/bin/bash}"
    ;;
  *)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
