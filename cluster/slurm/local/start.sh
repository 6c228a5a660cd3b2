#!/usr/bin/env bash
# Start a real two-node Slurm cluster on this one machine, for tests and for trying the recipes.
#
#   cluster/slurm/local/start.sh STATE_DIR     then: export SLURM_CONF=STATE_DIR/slurm.conf
#   cluster/slurm/local/stop.sh STATE_DIR      stops every daemon it started
#
# STATE_DIR is new, empty, or one that stop.sh left (it holds `stopped`): start.sh then removes what
# the last cluster left there (its logs, its jobs' state) and starts a new one. Each script prints one
# line saying what it did; the daemons' logs are STATE_DIR/*.log, the jobs' logs wherever the job
# script puts them (cluster/slurm/*.sbatch: _build/slurm/ in the checkout).
#
# Debian's slurm-wlm (22.05) and munge, run without systemd or cgroups: one munged, one
# slurmctld and two slurmd (n1, n2) on 127.0.0.1, every file inside STATE_DIR. Needs root (slurmd
# launches jobs as their user). On a real cluster none of this is needed: use cluster/slurm/*.sbatch.
set -euo pipefail
STATE=${1:?usage: start.sh STATE_DIR}
[ "$(id -u)" -eq 0 ] || { echo "start.sh: must run as root (slurmd starts jobs as their user)" >&2; exit 2; }
# The state directory holds the munge key, which mints credentials for any user, root included: it
# must be new, or an empty directory of root's own, never a link, and nobody else may write in it
# while the files are written (a link planted in it would make root write where it points).
umask 077
if [ -e "$STATE" ] || [ -L "$STATE" ]; then
  if [ -L "$STATE" ] || [ ! -d "$STATE" ] || [ "$(stat -c %u "$STATE")" != 0 ]; then
    echo "start.sh: STATE_DIR=$STATE exists and is not a directory owned by root; pass a new path (start.sh creates it)" >&2
    exit 2
  fi
  chmod 700 "$STATE"  # first: from here on only root can add entries
  if [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
    echo "start.sh: a cluster is running in STATE_DIR=$STATE (export SLURM_CONF=$STATE/slurm.conf); stop it first: stop.sh $STATE" >&2
    exit 2
  fi
  if [ -f "$STATE/stopped" ]; then
    # What a cluster that stop.sh stopped leaves, by name (rm does not follow links); anything else stays
    # and is refused below.
    rm -rf -- "$STATE"/{ctld,spool,stopped,slurm.conf,munge.key,munge.socket,munge.socket.lock} \
              "$STATE"/munged.{pid,log,seed} "$STATE"/slurmctld.{pid,log} "$STATE"/slurmd.*.{pid,log}
    AGAIN=" (a new cluster where stop.sh stopped the last)"
  fi
  if [ -n "$(ls -A "$STATE")" ]; then
    echo "start.sh: STATE_DIR=$STATE is not empty, and not a folder stop.sh left; pass a new path (start.sh creates it)" >&2
    exit 2
  fi
else
  mkdir -p -- "$(dirname -- "$STATE")"
  mkdir -m 700 -- "$STATE"  # fails if someone created it in between
fi
STATE=$(cd "$STATE" && pwd -P)
for bin in munged slurmctld slurmd sinfo; do
  command -v "$bin" >/dev/null || { echo "start.sh: $bin not found; install Debian's slurm-wlm and munge" >&2; exit 2; }
done
mkdir "$STATE/ctld" "$STATE/spool" "$STATE/spool/n1" "$STATE/spool/n2"
# Ports from the state directory's name, so two clusters on one machine do not collide; below 32768,
# where Linux's default ip_local_port_range starts, so no outgoing connection has been handed one.
BASE=$(( 20000 + $(printf '%s' "$STATE" | cksum | cut -d' ' -f1) % 12000 ))
# The cores this process may use. Not plain nproc: it reports OMP_NUM_THREADS when that is set
# (a common setting on clusters), and nodes declared with fewer cores than a job asks for leave
# the job pending for ever.
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)

dd if=/dev/urandom bs=1 count=1024 of="$STATE/munge.key" status=none
chmod 400 "$STATE/munge.key"
munged --force --key-file="$STATE/munge.key" --socket="$STATE/munge.socket" \
  --pid-file="$STATE/munged.pid" --log-file="$STATE/munged.log" --seed-file="$STATE/munged.seed"

cat > "$STATE/slurm.conf" <<CONF
ClusterName=labkit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$BASE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (the default is 120)
AuthInfo=socket=$STATE/munge.socket,cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# schedule every 2 s (default 60): a requeued job restarts within seconds
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
MinJobAge=600
KillWait=10
SlurmdTimeout=60
NodeName=n[1-2] NodeAddr=127.0.0.1 Port=[$((BASE + 1))-$((BASE + 2))] CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
CONF
export SLURM_CONF=$STATE/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N n1
slurmd -f "$SLURM_CONF" -N n2
for _ in $(seq 60); do
  if [ "$(sinfo -h -o '%T' -N 2>/dev/null | grep -c -E '^idle')" = 2 ]; then
    echo "Slurm is up: nodes n1 and n2 on 127.0.0.1, state in $STATE${AGAIN:-}: export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "start.sh: the nodes did not come up; see $STATE/*.log" >&2
sinfo -N >&2 || true
exit 1
