#!/usr/bin/env bash
# A real Slurm cluster on this host, for the tests: munged, slurmctld and two virtual nodes (slurmd -N n1/n2),
# all from Debian's slurm-wlm packages, run as root without systemd. The tests start and stop it
# (tests/test_slurm.py); by hand:
#
#   tests/slurm/cluster.sh start      # installs the packages if missing; idempotent: a no-op when it is up
#   source "$LAB/env.sh"              # SLURM_CONF for sbatch, squeue, scontrol, scancel
#   tests/slurm/cluster.sh stop       # cancels every job first, then stops the daemons it started
#
# LAB (default <repo>/.slurm-local) holds the config, state, logs and pid files. Both nodes have the address
# 127.0.0.1 and names (n1, n2) that do not resolve as host names, as on clusters whose node names are not in
# DNS: whatever needs a node's address must ask Slurm (`scontrol show node`).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB=${LAB:-$REPO/.slurm-local}
NNODES=2
# Each virtual node declares all of the host's cores (they share them): a node can then run a job of that many
# tasks, as a real node would; config_overrides keeps slurmd from draining a node that claims shared cores.
CPUS_PER_NODE=${CPUS_PER_NODE:-$(nproc)}
CTLD_PORT=${CTLD_PORT:-16817}
SLURMD_PORT0=${SLURMD_PORT0:-17001}
HOST=$(hostname -s)
CONF=$LAB/etc/slurm.conf
RUN=$LAB/run
export SLURM_CONF=$CONF

say() { echo "[slurm cluster] $*"; }

# is the pid in file $1 a live process named $2?
alive() { local p; [[ -s $1 ]] && p=$(cat "$1") && [[ -r /proc/$p/comm && $(cat "/proc/$p/comm") == "$2" ]]; }

stop_pidfile() {
  local f=$1 name=$2 p
  alive "$f" "$name" || { rm -f "$f"; return 0; }
  p=$(cat "$f")
  kill -TERM "$p"
  for _ in $(seq 100); do [[ -e /proc/$p ]] || break; sleep 0.1; done
  [[ -e /proc/$p ]] && kill -KILL "$p"
  rm -f "$f"
  say "stopped $name (pid $p)"
}

install_packages() {
  local missing="" p
  for p in slurmctld slurmd slurm-client munge; do
    dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing="$missing $p"
  done
  [[ -z $missing ]] && return 0
  [[ $(id -u) == 0 ]] || { say "missing Debian packages:$missing (installing them needs root)"; exit 1; }
  say "installing:$missing"
  apt-get update -qq
  # postinst scripts try to start services through invoke-rc.d; without systemd that is refused, harmlessly
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

write_config() {
  mkdir -p "$LAB"/{etc,run,log,state,munge,spool}
  chmod 700 "$LAB/munge"
  [[ -s $LAB/munge/munge.key ]] || dd if=/dev/urandom of="$LAB/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$LAB/munge/munge.key"
  cat > "$CONF.new" <<EOF
# written by tests/slurm/cluster.sh
ClusterName=dist_train_tests
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket.2
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LAB/log/jobcomp.log
# finished jobs stay visible to scontrol show job for an hour (no accounting database here)
MinJobAge=3600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SlurmdParameters=config_overrides
KillWait=5
NodeName=n[1-$NNODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$(( SLURMD_PORT0 + NNODES - 1 ))] CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [[ -f $CONF ]] && cmp -s "$CONF" "$CONF.new"; then rm "$CONF.new"; return 1; fi
  mv "$CONF.new" "$CONF"
  echo "export SLURM_CONF=$CONF" > "$LAB/env.sh"
  return 0
}

start() {
  install_packages
  if write_config && alive "$RUN/slurmctld.pid" slurmctld; then
    say "configuration changed: restarting"
    stop
  fi
  if ! alive "$RUN/munged.pid" munged; then
    munged --key-file="$LAB/munge/munge.key" --socket="$RUN/munge.socket.2" --pid-file="$RUN/munged.pid" \
      --log-file="$LAB/log/munged.log" --seed-file="$LAB/munge/munged.seed"
    say "started munged"
  fi
  if ! alive "$RUN/slurmctld.pid" slurmctld; then
    slurmctld -f "$CONF"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
    say "started slurmctld"
  fi
  for n in $(seq -f 'n%g' 1 "$NNODES"); do
    mkdir -p "$LAB/spool/$n"
    if ! alive "$RUN/slurmd-$n.pid" slurmd; then
      slurmd -f "$CONF" -N "$n"
      say "started slurmd $n"
    fi
  done
  local states=""
  for _ in $(seq 200); do
    states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
    [[ $states =~ ^((idle|mixed|allocated)\ )+$ ]] && { say "up: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"; return 0; }
    sleep 0.25
  done
  say "nodes not ready ($states); logs in $LAB/log"
  exit 1
}

stop() {
  if alive "$RUN/slurmctld.pid" slurmctld; then
    local ids
    ids=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $ids ]]; then timeout 10 scancel $ids || true; sleep 1; fi
  fi
  for f in "$RUN"/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
  stop_pidfile "$RUN/munged.pid" munged
  return 0
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop   (LAB=$LAB)" >&2; exit 2 ;;
esac
