#!/usr/bin/env bash
# A one-node SLURM cluster on this host, for trying `switchps role` and for CI (as root, Debian).
#
#   bash scripts/slurm-localhost.sh up     # install slurm-wlm + munge if missing, start munged,
#                                          # slurmctld and slurmd, wait until the node is idle
#   bash scripts/slurm-localhost.sh down   # stop exactly the daemons `up` started (their pid files)
#   export SLURM_CONF=/tmp/switchps-slurm/etc/slurm.conf   # for sinfo/sbatch/srun (`up` prints it)
#
# Everything lives under $SWITCHPS_SLURM_DIR (default /tmp/switchps-slurm): config, munge key and
# socket, state, spool, logs, pid files; nothing in /etc is written. The node is `hostname -s` at
# 127.0.0.1 and declares $SWITCHPS_SLURM_CPUS CPUs (default 16, via SlurmdParameters=config_overrides)
# so that a PS, an evaluator and several workers fit on a 2-core machine. Both commands are
# idempotent. On failure: exit 1 with one line saying why.
set -uo pipefail

DIR=${SWITCHPS_SLURM_DIR:-/tmp/switchps-slurm}
CPUS=${SWITCHPS_SLURM_CPUS:-16}
CONF=$DIR/etc/slurm.conf
SOCKET=$DIR/munge/munge.socket.2
WAIT_S=${SWITCHPS_SLURM_WAIT_S:-60}

fail() { echo "slurm-localhost: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process the pid file names is running
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null && return 0
    [[ $(id -u) == 0 ]] || fail "slurm-wlm/munge are not installed and installing them needs root"
    command -v apt-get >/dev/null || fail "slurm-wlm/munge are not installed and there is no apt-get"
    local log=$DIR/log/apt.log
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >"$log" 2>&1 \
        || fail "apt-get install slurm-wlm munge failed; see $log"
}

write_config() {
    local host; host=$(hostname -s)
    [[ -f $DIR/munge/munge.key ]] || { (umask 077; head -c 1024 /dev/urandom >"$DIR/munge/munge.key") \
        || fail "cannot write the munge key"; }
    cat >"$CONF.tmp" <<CONF
# Written by scripts/slurm-localhost.sh: a one-node cluster for switchps tests.
ClusterName=switchps
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${SWITCHPS_SLURMCTLD_PORT:-16817}
SlurmdPort=${SWITCHPS_SLURMD_PORT:-16818}
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$SOCKET,cred_expire=${SWITCHPS_SLURM_CRED_EXPIRE_S:-10}
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    mv "$CONF.tmp" "$CONF"
}

start() {  # start NAME PIDFILE COMMAND...: unless already running
    local name=$1 pidfile=$2; shift 2
    alive "$pidfile" && return 0
    "$@" >>"$DIR/log/$name.out" 2>&1 || fail "$name did not start; see $DIR/log/$name.out and $DIR/log/$name.log"
}

up() {
    mkdir -p "$DIR"/{etc,munge,state,spool,log,run} || fail "cannot create $DIR"
    chmod 700 "$DIR/munge"
    install
    write_config
    start munged "$DIR/run/munged.pid" munged --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
        --log-file="$DIR/log/munged.log" --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed"
    start slurmctld "$DIR/run/slurmctld.pid" slurmctld -f "$CONF"
    start slurmd "$DIR/run/slurmd.pid" slurmd -f "$CONF"
    export SLURM_CONF=$CONF
    local end=$((SECONDS + WAIT_S)) state=""
    while ((SECONDS < end)); do
        state=$(sinfo -h -N -o %t 2>/dev/null | head -1)
        [[ $state == idle || $state == mix || $state == alloc ]] && break
        [[ $state == down* || $state == drain* ]] && scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1
        sleep 0.5
    done
    [[ $state == idle || $state == mix || $state == alloc ]] \
        || fail "the node is not idle after ${WAIT_S}s (state '${state:-none}'); see $DIR/log/"
    echo "slurm-localhost: up (node $(hostname -s), $CPUS CPUs); export SLURM_CONF=$CONF"
}

down() {
    local name
    for name in slurmd slurmctld munged; do
        local pidfile=$DIR/run/$name.pid
        if alive "$pidfile"; then
            local pid; pid=$(cat "$pidfile")
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
        rm -f "$pidfile"
    done
    echo "slurm-localhost: down"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
