#!/usr/bin/env bash
# A real Slurm cluster on this host, for the tests: munged, slurmctld and two virtual nodes (slurmd -N n1/n2),
# all from Debian's slurm-wlm packages, run as root without systemd. The tests start and stop it
# (tests/launched/test_slurm.py); by hand:
#
#   tests/slurm/cluster.sh start      # installs the packages if missing; idempotent: a no-op when it is up
#   source "$LAB/env.sh"              # SLURM_CONF for sbatch, squeue, scontrol, scancel
#   tests/slurm/cluster.sh stop       # cancels every job first, then stops the daemons it started
#
# LAB (default <repo>/.slurm-local) holds the config, state, logs and pid files. Both nodes have the address
# 127.0.0.1 and names (n1, n2) that do not resolve as host names, as on clusters whose node names are not in
# DNS: whatever needs a node's address must ask Slurm (`scontrol show node`).
#
# Ports: slurmctld's and one per slurmd, picked free at start (the previous ones while they are still free, so
# that the config stays the same), below the kernel's ephemeral range; CTLD_PORT and SLURMD_PORT0 (the first
# node's; node i takes SLURMD_PORT0+i-1) force them. A start that fails stops every daemon it started, and its
# last line (stderr) names the daemon that failed and its log.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB=${LAB:-$REPO/.slurm-local}
NNODES=2
# Each virtual node declares all of the host's cores (they share them): a node can then run a job of that many
# tasks, as a real node would; config_overrides keeps slurmd from draining a node that claims shared cores. nproc
# without OMP_NUM_THREADS, which it would report instead (the tests run with OMP_NUM_THREADS=1).
CPUS_PER_NODE=${CPUS_PER_NODE:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
HOST=$(hostname -s)
CONF=$LAB/etc/slurm.conf
RUN=$LAB/run
LOG=$LAB/log
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

# ------------------------------------------------------------------------------------------------ ports
# Every local TCP port that a socket holds, from the kernel's tables. A port in TIME_WAIT (state 06) is free to
# the daemons: Slurm binds its ports with SO_REUSEADDR.
ports_in_use() {
  local _ local_address state _rest
  { cat /proc/net/tcp /proc/net/tcp6 2>/dev/null || true; } | while read -r _ local_address _ state _rest; do
    if [[ $local_address == *:* && $state != 06 ]]; then echo $(( 16#${local_address##*:} )); fi
  done | sort -un
}

# The first of $1 consecutive ports, from $2 up, that no socket holds and that are not in $3 (ports already given
# out), below the ephemeral range (where the kernel picks the ports of outgoing connections).
free_ports() {
  local count=$1 port=$2 taken=" $(ports_in_use | tr '\n' ' ') $3 " ephemeral i ok
  ephemeral=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
  while (( port + count <= ephemeral )); do
    ok=1
    for (( i = 0; i < count; i++ )); do [[ $taken == *" $(( port + i )) "* ]] && { ok=0; break; }; done
    (( ok )) && { echo "$port"; return 0; }
    port=$(( port + 1 ))
  done
  return 1
}

# The port the current config gives slurmctld (ctld) or the first node's slurmd (slurmd); nothing without a config.
configured_port() {
  [[ -f $CONF ]] || return 0
  case $1 in
    ctld) sed -n 's/^SlurmctldPort=\([0-9]*\)$/\1/p' "$CONF" ;;
    slurmd) sed -n 's/.* Port=\[\([0-9]*\)-.*/\1/p' "$CONF" ;;
  esac
}

# CTLD_PORT and SLURMD_PORT0: forced, else the configured ones while the cluster runs or while they are free,
# else the first free ones.
pick_ports() {
  local ctld slurmd
  ctld=$(configured_port ctld) slurmd=$(configured_port slurmd)
  if ! alive "$RUN/slurmctld.pid" slurmctld; then
    [[ -n $ctld && $(free_ports 1 "$ctld" "") == "$ctld" ]] || ctld=""
    [[ -n $slurmd && $(free_ports "$NNODES" "$slurmd" "${CTLD_PORT:-$ctld}") == "$slurmd" ]] || slurmd=""
  fi
  CTLD_PORT=${CTLD_PORT:-${ctld:-$(free_ports 1 16817 "")}}
  SLURMD_PORT0=${SLURMD_PORT0:-${slurmd:-$(free_ports "$NNODES" 17001 "$CTLD_PORT")}}
  [[ -n $CTLD_PORT && -n $SLURMD_PORT0 ]] || { say "no free ports below the ephemeral range for Slurm"; exit 1; }
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
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
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

# ------------------------------------------------------------------------------------------------ start
STARTED_PIDFILES=() STARTED_NAMES=()  # the daemons this start launched, in order
FAILURE=""  # what failed, and where its log is

# On a failed start (an error, or Ctrl-C): stop what this start launched, newest first (what ran before is left),
# then say what failed, last, on stderr.
undo_start() {
  local rc=$? i
  trap - EXIT
  (( rc == 0 )) && return 0
  for (( i = ${#STARTED_PIDFILES[@]} - 1; i >= 0; i-- )); do
    stop_pidfile "${STARTED_PIDFILES[i]}" "${STARTED_NAMES[i]}" || true
  done
  say "start failed: ${FAILURE:-exit $rc}" >&2
  exit "$rc"
}

# fail WHAT LOG: end the start, saying which daemon failed and where its log is (and the log's last lines).
fail() {
  FAILURE="$1; its log: $2"
  [[ -s $2 ]] && { echo "last lines of $2:"; tail -n 5 "$2" | sed 's/^/    /'; } >&2
  exit 1
}

# launch LABEL NAME PIDFILE LOG COMMAND...: run a daemon's command (it forks into the background) and wait for its
# pid file to name a live NAME. What the daemon prints before it opens LOG goes to LOG.stderr.
launch() {
  local label=$1 name=$2 pidfile=$3 log=$4 rc=0
  shift 4
  STARTED_PIDFILES+=("$pidfile") STARTED_NAMES+=("$name")
  "$@" 2>>"$log.stderr" || rc=$?
  (( rc == 0 )) || fail "$label did not start (exit $rc; its stderr: $log.stderr)" "$log"
  for _ in $(seq 50); do
    alive "$pidfile" "$name" && { say "started $label (pid $(cat "$pidfile"))"; return 0; }
    sleep 0.1
  done
  fail "$label exited right after starting (its stderr: $log.stderr)" "$log"
}

# Fail, naming it, if a daemon of the cluster is gone (the slurmd ones too, with `nodes`: once they are launched).
check_daemons() {
  local n
  alive "$RUN/munged.pid" munged || fail "munged exited" "$LOG/munged.log"
  alive "$RUN/slurmctld.pid" slurmctld || fail "slurmctld exited (port $CTLD_PORT)" "$LOG/slurmctld.log"
  [[ ${1:-} == nodes ]] || return 0
  for n in $(seq -f 'n%g' 1 "$NNODES"); do
    alive "$RUN/slurmd-$n.pid" slurmd \
      || fail "slurmd $n exited (port $(( SLURMD_PORT0 + ${n#n} - 1 )))" "$LOG/slurmd-$n.log"
  done
}

start() {
  install_packages
  pick_ports
  if write_config && alive "$RUN/slurmctld.pid" slurmctld; then
    say "configuration changed: restarting"
    stop
  fi
  trap undo_start EXIT
  trap 'FAILURE="interrupted (SIGINT)"; exit 130' INT
  trap 'FAILURE="terminated (SIGTERM)"; exit 143' TERM
  alive "$RUN/munged.pid" munged || launch munged munged "$RUN/munged.pid" "$LOG/munged.log" \
    munged --key-file="$LAB/munge/munge.key" --socket="$RUN/munge.socket.2" --pid-file="$RUN/munged.pid" \
    --log-file="$LOG/munged.log" --seed-file="$LAB/munge/munged.seed"
  if ! alive "$RUN/slurmctld.pid" slurmctld; then
    launch slurmctld slurmctld "$RUN/slurmctld.pid" "$LOG/slurmctld.log" slurmctld -f "$CONF"
    for _ in $(seq 100); do
      scontrol ping 2>/dev/null | grep -q 'is UP' && break
      check_daemons
      sleep 0.2
    done
    scontrol ping 2>/dev/null | grep -q 'is UP' \
      || fail "slurmctld does not answer on port $CTLD_PORT" "$LOG/slurmctld.log"
  fi
  for n in $(seq -f 'n%g' 1 "$NNODES"); do
    mkdir -p "$LAB/spool/$n"
    alive "$RUN/slurmd-$n.pid" slurmd \
      || launch "slurmd $n" slurmd "$RUN/slurmd-$n.pid" "$LOG/slurmd-$n.log" slurmd -f "$CONF" -N "$n"
  done
  wait_for_nodes
  trap - EXIT INT TERM
}

# Until every node is idle (or busy with jobs). A daemon that exits meanwhile fails the start at once, named; a node
# still not ready after 50 s is named with its slurmd's log.
wait_for_nodes() {
  local n state
  for _ in $(seq 200); do
    [[ $(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ') =~ ^((idle|mixed|allocated)\ )+$ ]] \
      && { say "up: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"; return 0; }
    check_daemons nodes
    sleep 0.25
  done
  for n in $(seq -f 'n%g' 1 "$NNODES"); do
    state=$(sinfo -h -n "$n" -o '%T' 2>/dev/null || true)
    [[ $state =~ ^(idle|mixed|allocated)$ ]] || fail "slurmd $n runs, but slurmctld has node $n ${state:-unknown} \
(slurmctld's log: $LOG/slurmctld.log)" "$LOG/slurmd-$n.log"
  done
  say "up: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"
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
