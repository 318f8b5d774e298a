#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests (and for trying Corral on PostgreSQL):
# its own data dir, listening on a unix socket in that dir only (no TCP), run as
# the postgres user. Prints the SQLAlchemy URL on start.
#
#   scripts/postgres.sh start DIR    # idempotent
#   scripts/postgres.sh stop DIR
set -euo pipefail
action="${1:?start or stop}"
dir="${2:?a directory}"
bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
[[ -n "$bin" ]] || { echo "postgres.sh: PostgreSQL is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
as_postgres() { runuser -u postgres -- "$@"; }

case "$action" in
start)
    mkdir -p "$dir"
    chown postgres "$dir"
    chmod 0755 "$dir"
    if [[ ! -f "$dir/data/PG_VERSION" ]]; then
        as_postgres "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
    fi
    if ! as_postgres "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
            -o "-k $dir -c listen_addresses= -c fsync=off" start >/dev/null
    fi
    as_postgres "$bin/psql" -h "$dir" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='corral'" \
        | grep -q 1 || as_postgres "$bin/createdb" -h "$dir" -U postgres corral
    echo "postgresql+psycopg://postgres@/corral?host=$dir"
    ;;
stop)
    if [[ -f "$dir/data/PG_VERSION" ]]; then
        as_postgres "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
    ;;
*)
    echo "postgres.sh: start or stop" >&2
    exit 2
    ;;
esac
