#!/usr/bin/env bash
# A real multi-node Slurm 22.05 on this one machine, for the Slurm tests (needs root).
#
#   bash scripts/slurm_cluster.sh up [--nodes N]   # bridge, N network namespaces, munged, slurmctld, N slurmds
#   bash scripts/slurm_cluster.sh down             # everything removed: no pids, netns, links left
#   bash scripts/slurm_cluster.sh env              # prints `export SLURM_CONF=...` for sbatch/srun/scontrol
#
# Each node nK lives in its own network namespace (ptops-nK) at 10.77.0.(10+K) on a bridge
# (ptops-br0, 10.77.0.1 = the controller "ctl" in the root namespace), with its own hostname (UTS
# namespace) and a private /etc/hosts (mount namespace) naming every node. Nodes share the kernel,
# the filesystem (as NFS would), the CPUs and the pid namespace: they are real slurmds, not real hosts.
# Why not `ip netns exec`: it remounts /sys and slurmd then fails to set up its cgroup plugin.
# Idempotent: `up` on a running cluster with the same node count does nothing; another count restarts it.
set -euo pipefail

STATE=${PTOPS_SLURM_DIR:-/tmp/ptops-slurm}
BR=ptops-br0
NET=10.77.0
CONF=$STATE/slurm.conf

die() { echo "error: slurm_cluster.sh: $*" >&2; exit 2; }

nodes_of() { cat "$STATE/nodes" 2>/dev/null || echo 0; }

running() {
  [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null
}

down() {
  local n
  n=$(nodes_of)
  # slurmctld first (else it reschedules), then every process in each node's namespace, then links
  for f in "$STATE"/slurmctld.pid "$STATE"/node-*.pid; do
    [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null || true
  done
  for ns in $(ip netns list 2>/dev/null | awk '/^ptops-n[0-9]+/{print $1}'); do
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
  done
  sleep 0.3
  for ns in $(ip netns list 2>/dev/null | awk '/^ptops-n[0-9]+/{print $1}'); do
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
  done
  for f in "$STATE"/slurmctld.pid "$STATE"/munged.pid "$STATE"/munge/munged.pid "$STATE"/node-*.pid; do
    [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
  # anything of ours still holding the config (slurmstepd of a killed job)
  for p in $(pgrep -f "slurmstepd|slurmd -D -f $CONF|slurmctld -D -i -f $CONF" 2>/dev/null || true); do
    grep -qa "ptops-slurm\|$STATE" "/proc/$p/cmdline" "/proc/$p/environ" 2>/dev/null && kill -KILL "$p" 2>/dev/null || true
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^pv-n[0-9]+$' || true); do
    ip link delete "$l" 2>/dev/null || true
  done
  ip link delete "$BR" 2>/dev/null || true
  rm -f "$STATE/nodes"
}

up() {
  local n=$1
  [ "$(id -u)" = 0 ] || die "needs root (network, mount and UTS namespaces)"
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    || die "slurmctld/slurmd/munged not installed (bash scripts/setup.sh --slurm, or apt-get install slurmctld slurmd slurm-client munge)"
  if running && [ "$(nodes_of)" = "$n" ] && sinfo_ok "$n"; then
    echo "slurm_cluster: already up ($n nodes, SLURM_CONF=$CONF)" >&2
    return 0
  fi
  down
  mkdir -p "$STATE"/{log,spool,munge}
  chmod 755 "$STATE"

  # ---- network: a bridge and one veth pair per node
  ip link add "$BR" type bridge
  ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 ctl"
    for i in $(seq 1 "$n"); do echo "$NET.$((10 + i)) n$i"; done
  } > "$STATE/hosts"
  for i in $(seq 1 "$n"); do
    ip netns add "ptops-n$i"
    ip link add "pv-n$i" type veth peer name "eth-n$i"
    ip link set "eth-n$i" netns "ptops-n$i"
    ip link set "pv-n$i" master "$BR"
    ip link set "pv-n$i" up
    ip -n "ptops-n$i" addr add "$NET.$((10 + i))/24" dev "eth-n$i"
    ip -n "ptops-n$i" link set "eth-n$i" up
    ip -n "ptops-n$i" link set lo up
  done

  # ---- munge: its own key and socket (one path-based socket serves every namespace)
  # (the socket's folder must be world-executable, the key's private)
  mkdir -p "$STATE/munge/key"
  if [ ! -f "$STATE/munge/key/munge.key" ]; then
    dd if=/dev/urandom of="$STATE/munge/key/munge.key" bs=1024 count=1 status=none
  fi
  chown -R munge:munge "$STATE/munge"
  chmod 755 "$STATE/munge"
  chmod 700 "$STATE/munge/key"
  chmod 400 "$STATE/munge/key/munge.key"
  runuser -u munge -- munged -F --key-file="$STATE/munge/key/munge.key" --socket="$STATE/munge/munge.sock" \
    --pid-file="$STATE/munge/munged.pid" --seed-file="$STATE/munge/seed" --log-file="$STATE/munge/munged.log" \
    </dev/null >/dev/null 2>&1 &
  echo $! > "$STATE/munged.pid"
  for _ in $(seq 50); do [ -S "$STATE/munge/munge.sock" ] && break; sleep 0.05; done
  [ -S "$STATE/munge/munge.sock" ] || die "munged did not start (see $STATE/munge/munged.log)"
  chmod 755 "$STATE/munge"

  # ---- slurm.conf
  local cpus
  cpus=$(nproc)
  cat > "$CONF" <<EOF
ClusterName=ptops
SlurmctldHost=ctl($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.daemon.pid
SlurmdPidFile=$STATE/spool/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
MpiDefault=none
JobRequeue=1
PropagateResourceLimitsExcept=ALL
EOF
  for i in $(seq 1 "$n"); do
    echo "NodeName=n$i NodeAddr=$NET.$((10 + i)) CPUs=$cpus RealMemory=4000 State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$CONF"
  cat > "$STATE/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
ConstrainCores=no
ConstrainRAMSpace=no
EOF
  mkdir -p "$STATE/spool/ctld"

  # ---- slurmctld (its hostname must equal SlurmctldHost) and one slurmd per node
  cat > "$STATE/ctld.sh" <<EOF
#!/bin/bash
hostname ctl
exec slurmctld -D -i -f $CONF
EOF
  SLURM_CONF=$CONF unshare --uts -- bash "$STATE/ctld.sh" </dev/null >"$STATE/log/slurmctld.out" 2>&1 &
  echo $! > "$STATE/slurmctld.pid"
  for i in $(seq 1 "$n"); do
    mkdir -p "$STATE/spool/n$i"
    cat > "$STATE/node-n$i.sh" <<EOF
#!/bin/bash
hostname n$i
mount --bind $STATE/hosts /etc/hosts
exec slurmd -D -f $CONF -N n$i
EOF
    SLURM_CONF=$CONF nsenter --net="/run/netns/ptops-n$i" unshare --uts --mount -- bash "$STATE/node-n$i.sh" \
      </dev/null >"$STATE/log/slurmd-n$i.out" 2>&1 &
    echo $! > "$STATE/node-n$i.pid"
  done
  echo "$n" > "$STATE/nodes"
  for _ in $(seq 150); do
    sinfo_ok "$n" && { echo "slurm_cluster: up ($n nodes n1..n$n, SLURM_CONF=$CONF)" >&2; return 0; }
    sleep 0.1
  done
  die "nodes not idle after 15 s (see $STATE/log/)"
}

sinfo_ok() {
  local idle
  idle=$(SLURM_CONF=$CONF sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l) || return 1
  [ "$idle" -ge "$1" ]
}

cmd=${1:-}
shift || true
nodes=2
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) die "unknown option $1 (expected --nodes N)" ;;
  esac
done
[[ "$nodes" =~ ^[1-9][0-9]?$ ]] || die "--nodes: expected 1..99, got $nodes"
case "$cmd" in
  up) up "$nodes" ;;
  down) down; echo "slurm_cluster: down" >&2 ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: slurm_cluster.sh up [--nodes N] | down | env" ;;
esac
