#!/usr/bin/env bash
# Stop the local Slurm cluster started by start.sh STATE_DIR: cancel its jobs, then every daemon.
set -uo pipefail
STATE=${1:?usage: stop.sh STATE_DIR}
export SLURM_CONF=$STATE/slurm.conf
if [ -f "$SLURM_CONF" ]; then
  scancel --full --quiet --user="$(id -un)" 2>/dev/null
  sleep 1
fi
for pidfile in "$STATE"/slurmd.*.pid "$STATE/slurmctld.pid" "$STATE/munged.pid"; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
done
# job steps slurmd left behind (linuxproc tracks, but a SIGKILLed slurmd cannot reap)
pkill -f "slurmstepd: \[" 2>/dev/null
exit 0
