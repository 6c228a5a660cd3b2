#!/usr/bin/env bash
# Stop the local Slurm cluster started by start.sh STATE_DIR: cancel its jobs, then every daemon.
# Only this cluster's processes: another local cluster (another STATE_DIR) on the host keeps running.
set -uo pipefail
STATE=${1:?usage: stop.sh STATE_DIR}
[ -d "$STATE" ] || { echo "stop.sh: $STATE is not a directory" >&2; exit 2; }
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
# Job steps slurmd left behind (linuxproc tracks, but a SIGKILLed slurmd cannot reap). A
# slurmstepd is this cluster's when its environment names this cluster's slurm.conf: start.sh
# exports SLURM_CONF before starting slurmd, which passes its environment on to each slurmstepd.
steps=()
for pid in $(pgrep -f '^slurmstepd: \['); do
  conf=$(tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | sed -n 's/^SLURM_CONF=//p')
  # -ef: the same directory however it is spelt (relative, through a symlink)
  if [ -n "$conf" ] && [ "$(dirname "$conf")" -ef "$STATE" ]; then steps+=("$pid"); fi
done
[ "${#steps[@]}" -eq 0 ] || kill "${steps[@]}" 2>/dev/null
exit 0
