#!/usr/bin/env bash
# Stop the local Slurm cluster started by start.sh STATE_DIR: cancel its jobs, then every daemon.
# Only this cluster's processes: another local cluster (another STATE_DIR) on the host keeps running.
# It prints one line saying what it stopped, and leaves STATE_DIR (the daemons' logs, the jobs' state)
# with a file named `stopped` in it, so that start.sh STATE_DIR can start a new cluster there.
set -uo pipefail
STATE=${1:?usage: stop.sh STATE_DIR}
[ -d "$STATE" ] || { echo "stop.sh: $STATE is not a directory" >&2; exit 2; }
export SLURM_CONF=$STATE/slurm.conf
jobs=0
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ -f "$SLURM_CONF" ] && alive "$STATE/slurmctld.pid"; then
  jobs=$(squeue -h -o %i 2>/dev/null | wc -l)
  if [ "$jobs" -gt 0 ]; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null
    sleep 1
  fi
fi
# TERM to the daemons of one kind at once, SIGKILL to any still there after 5 s
stop() {
  local pids=() names=() pidfile pid
  for pidfile in "$@"; do
    alive "$pidfile" || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null && { pids+=("$pid"); names+=("$(basename "$pidfile" .pid | tr . ' ')"); }
  done
  for _ in $(seq 50); do
    kill -0 "${pids[@]}" 2>/dev/null || break  # true while any is left
    sleep 0.1
  done
  [ "${#pids[@]}" -eq 0 ] || kill -9 "${pids[@]}" 2>/dev/null
  STOPPED+=("${names[@]}")
}
STOPPED=()
stop "$STATE"/slurmd.*.pid
stop "$STATE/slurmctld.pid" "$STATE/munged.pid"
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
if [ -f "$SLURM_CONF" ]; then
  echo "stopped by stop.sh on $(date '+%F %T'); start.sh $STATE starts a new cluster here" > "$STATE/stopped"
fi
if [ "${#STOPPED[@]}" -eq 0 ]; then
  echo "stop.sh: nothing was running in $STATE; start.sh $STATE starts a cluster there"
else
  daemons=$(IFS=,; echo "${STOPPED[*]}")
  echo "Slurm in $STATE stopped: $jobs job(s) cancelled; stopped ${daemons//,/, }; start.sh $STATE starts it again"
fi
exit 0
