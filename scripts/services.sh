#!/usr/bin/env bash
# Make sure the services duetime needs are up on loopback (idempotent).
# PostgreSQL and RabbitMQ are expected to be running (this machine's image starts them);
# we try to start them if they are installed but down. etcd is installed from Debian
# (etcd-server) when missing and started on 127.0.0.1:2379 with data under .run/etcd.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="$PWD/.run"
mkdir -p "$RUN_DIR"

say() { printf 'services: %s\n' "$*"; }

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() { # host port seconds
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    if port_open "$1" "$2"; then return 0; fi
    sleep 0.1
  done
  return 1
}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# --- PostgreSQL ----------------------------------------------------------------------
if port_open 127.0.0.1 5432; then
  say "postgresql up on 127.0.0.1:5432"
else
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    say "postgresql down; starting it"
    as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  wait_port 127.0.0.1 5432 30 || { say "ERROR: PostgreSQL is not reachable on 127.0.0.1:5432"; exit 1; }
fi

# --- RabbitMQ ------------------------------------------------------------------------
if port_open 127.0.0.1 5672; then
  say "rabbitmq up on 127.0.0.1:5672"
else
  if command -v rabbitmq-server >/dev/null 2>&1; then
    say "rabbitmq down; starting it"
    as_root rabbitmq-server -detached || true
  fi
  wait_port 127.0.0.1 5672 60 || { say "ERROR: RabbitMQ is not reachable on 127.0.0.1:5672"; exit 1; }
fi

# --- etcd ----------------------------------------------------------------------------
if ! command -v etcd >/dev/null 2>&1; then
  say "etcd missing; installing Debian's etcd-server"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq etcd-server etcd-client >/dev/null
  # Debian's package may start a system etcd on 2379 through its init script; ours
  # must own the port with its own data dir, so stop that one if it appeared.
  if command -v systemctl >/dev/null 2>&1; then as_root systemctl stop etcd 2>/dev/null || true; fi
  pkill -x etcd 2>/dev/null || true
  sleep 0.5
fi

# --- PgBouncer (a binary only: tests/integration/test_pgbouncer.py runs private ones) --
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  say "pgbouncer missing; installing Debian's pgbouncer"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get install -y -qq pgbouncer >/dev/null 2>&1 \
    || { as_root apt-get update -qq && as_root apt-get install -y -qq pgbouncer >/dev/null; }
  if command -v systemctl >/dev/null 2>&1; then as_root systemctl stop pgbouncer 2>/dev/null || true; fi
  pkill -x pgbouncer 2>/dev/null || true
fi

ETCD_PID="$RUN_DIR/etcd.pid"
if port_open 127.0.0.1 2379; then
  say "etcd up on 127.0.0.1:2379"
else
  mkdir -p "$RUN_DIR/etcd"
  say "starting etcd on 127.0.0.1:2379 (data $RUN_DIR/etcd, log $RUN_DIR/etcd.log)"
  nohup etcd --name duetime-dev \
    --data-dir "$RUN_DIR/etcd/data" \
    --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster duetime-dev=http://127.0.0.1:2380 \
    --auto-compaction-retention 1 \
    >"$RUN_DIR/etcd.log" 2>&1 </dev/null &
  echo $! >"$ETCD_PID"
  if ! wait_port 127.0.0.1 2379 30; then
    say "ERROR: etcd did not come up; last log lines:"; tail -n 20 "$RUN_DIR/etcd.log"; exit 1
  fi
  for _ in $(seq 1 50); do
    if ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:2379 endpoint health >/dev/null 2>&1; then break; fi
    sleep 0.2
  done
  say "etcd up (pid $(cat "$ETCD_PID"))"
fi
