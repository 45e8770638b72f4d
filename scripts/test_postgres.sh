#!/usr/bin/env bash
# The test suite's own PostgreSQL server: `scripts/test_postgres.sh start|stop|url`.
#
# Why: `make test` runs the suite in two pytest processes (pytest-xdist). Each opens the
# pools of the workers, replicas and CLIs its tests start, and two of those at once can
# pass the 100 connections of the machine's shared server (measured: "too many clients"
# in 3 tests of 700 with three processes). This server has the shared one's settings
# (PostgreSQL 15, autovacuum off, fsync on, 128 MB shared buffers) but room for 300
# connections, and nothing else uses it. It listens on 127.0.0.1:$DUETIME_TEST_PG_PORT
# (default 55432), keeps its data in /tmp/duetime-testpg-<port> (initdb and postgres
# refuse to run as root: as root it runs as the `postgres` user) and is started once,
# then reused: `start` is idempotent.
set -euo pipefail
cd /  # runuser drops to postgres, who may not enter the caller's directory
PORT="${DUETIME_TEST_PG_PORT:-55432}"
DIR="/tmp/duetime-testpg-$PORT"
BIN="${DUETIME_TEST_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)}"
URL="postgresql://postgres@127.0.0.1:$PORT/postgres"

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

case "${1:-}" in
  url) echo "$URL" ;;
  start)
    if port_open "$PORT"; then echo "test postgres: up on 127.0.0.1:$PORT"; exit 0; fi
    [ -x "$BIN/initdb" ] || { echo "test postgres: no initdb under $BIN" >&2; exit 1; }
    if [ ! -f "$DIR/data/PG_VERSION" ]; then
      rm -rf "$DIR"
      mkdir -p "$DIR"
      [ "$(id -u)" = 0 ] && chown postgres: "$DIR"
      as_pg "$BIN/initdb" -D "$DIR/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 \
        >"$DIR/initdb.log" 2>&1 || { cat "$DIR/initdb.log" >&2; exit 1; }
    fi
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/postgres.log" -w -t 60 start -o \
      "-c port=$PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$DIR \
       -c max_connections=300 -c shared_buffers=128MB -c autovacuum=off -c TimeZone=UTC \
       -c max_wal_size=1GB" >/dev/null || { tail -n 20 "$DIR/postgres.log" >&2; exit 1; }
    echo "test postgres: started on 127.0.0.1:$PORT ($DIR)"
    ;;
  stop)
    if [ -f "$DIR/data/postmaster.pid" ]; then
      as_pg "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null || true
    fi
    rm -rf "$DIR"
    ;;
  *) echo "usage: $0 start|stop|url" >&2; exit 2 ;;
esac
