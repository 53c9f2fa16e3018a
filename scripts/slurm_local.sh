#!/usr/bin/env bash
# A real two-node Slurm cluster on this one host, for the tests and for trying a job by hand:
#   scripts/slurm_local.sh start DIR   - munged, slurmctld and two slurmd (node1, node2) under DIR;
#                                        prints the SLURM_CONF to export
#   scripts/slurm_local.sh stop DIR    - stops every daemon started under DIR, waits them out and
#                                        removes DIR
# Needs root and Debian's slurmctld, slurmd, slurm-client and munge (scripts/env.sh test installs
# them). No systemd: each daemon is started by hand with its state, spool, socket and logs under DIR,
# so clusters in different DIRs do not meet (each picks free ports). The nodes' NodeAddr is
# 127.0.0.1: their names (node1, node2) do not resolve as host names.
set -euo pipefail

usage() { echo "usage: scripts/slurm_local.sh start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
dir=$(realpath -m "$2")

stop() {
  local pidfile pid
  [ -d "$dir" ] || return 0
  for pidfile in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  # A job's steps outlive their slurmd only under proctrack/pgid's process groups: none may stay.
  pkill -9 -f "slurmstepd.*$dir" 2>/dev/null || true
  rm -rf "$dir"
}

case "$cmd" in
  stop) stop; exit 0 ;;
  start) ;;
  *) usage ;;
esac

for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || {
    echo "slurm_local: $tool not found: install slurmctld slurmd slurm-client munge" \
      "(scripts/env.sh test does)" >&2
    exit 1
  }
done
[ "$(id -u)" = 0 ] || { echo "slurm_local: needs root (the daemons run as root and munge)" >&2; exit 1; }
[ ! -e "$dir" ] || { echo "slurm_local: $dir exists; stop that cluster first" >&2; exit 1; }

trap 'status=$?; [ $status -eq 0 ] || { tail -n 20 "$dir"/log/* "$dir"/munge/munged.log 2>/dev/null >&2; stop; }' EXIT
mkdir -p "$dir"/{state,log,spool/node1,spool/node2,munge}
# As root (--force): the munge user cannot reach a socket under a private directory (pytest's
# are 0700), and every client here (the daemons, sbatch, the tests) is root anyway.
(umask 077 && head -c 1024 /dev/urandom >"$dir/munge/munge.key")  # this cluster's own key
munged --force --socket="$dir/munge/sock" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed"

read -r ctld_port node1_port node2_port < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
cat >"$dir/slurm.conf" <<EOF
ClusterName=porting
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire before it may start again (120 s by default): kept short here
AuthInfo=socket=$dir/munge/sock,cred_expire=20
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# no cgroups without systemd: process groups track a job's processes
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# one CPU per node on a host with more: the declared configuration wins
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
# finished jobs stay visible to scontrol this long (there is no slurmdbd, hence no sacct)
MinJobAge=600
KillWait=5
InactiveLimit=0
# One "GPU" per node, a count with no device behind it: the scripts a GPU cluster gets (with
# --gpus-per-node) are accepted and scheduled as they are; the ranks find no CUDA and use gloo.
GresTypes=gpu
NodeName=node1 NodeAddr=127.0.0.1 Port=$node1_port CPUs=1 RealMemory=8000 Gres=gpu:1 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port=$node2_port CPUs=1 RealMemory=8000 Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
# a GPU GRES needs a device file; /dev/null stands in (AutoDetect off: nothing is probed)
printf 'AutoDetect=off\nNodeName=node[1-2] Name=gpu File=/dev/null\n' >"$dir/gres.conf"
export SLURM_CONF="$dir/slurm.conf"
slurmctld -i
slurmd -N node1
slurmd -N node2
for _ in $(seq 150); do
  if [ "$(sinfo -h -o '%t %D' 2>/dev/null)" = "idle 2" ]; then
    trap - EXIT
    echo "export SLURM_CONF=$dir/slurm.conf"
    exit 0
  fi
  sleep 0.2
done
echo "slurm_local: the two nodes did not come up idle in 30 s: $(sinfo -h 2>&1)" >&2
exit 1
