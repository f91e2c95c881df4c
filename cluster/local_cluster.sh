#!/usr/bin/env bash
# A local Ray cluster on the loopback interface, for `bigrank submit` and `bigrank train --address`.
#
#   cluster/local_cluster.sh start [--worker]   head on 127.0.0.1 (+ one worker node on the same machine)
#   cluster/local_cluster.sh status             which of its processes run, and the addresses to use
#   cluster/local_cluster.sh stop               end exactly the processes this script started
#
# Then:  bigrank submit configs/demo.yaml --address http://127.0.0.1:8265 --wait
#        bigrank train configs/demo.yaml --launcher ray --set ray.address=127.0.0.1:6379
#
# Settings (environment): BIGRANK_RAY_DIR (state, logs, Ray's temp dir; default /tmp/bigrank-ray),
# RAY_PORT (GCS, 6379), DASHBOARD_PORT (Jobs API, 8265), HEAD_CPUS (default: all), WORKER_CPUS (1).
# Each node runs `ray start --block` in its own process group, recorded in BIGRANK_RAY_DIR/*.pid; `stop`
# signals those groups only (never `ray stop`, which would end every Ray on the machine).
# Token authentication is on: the token is ~/.ray/auth_token (made here if missing), which bigrank reads;
# other machines need a copy of it (or RAY_AUTH_TOKEN).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${BIGRANK_RAY_DIR:-/tmp/bigrank-ray}"
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
HEAD_CPUS="${HEAD_CPUS:-$(nproc)}"
WORKER_CPUS="${WORKER_CPUS:-1}"

# The project's venv first on PATH: the head runs submitted jobs' `python -m bigrank...` with it.
if [[ -x "$REPO/.venv/bin/ray" ]]; then
  export PATH="$REPO/.venv/bin:$PATH"
fi
command -v ray >/dev/null || { echo "ray is not installed (run make setup)" >&2; exit 1; }
PY="$(command -v python3 || command -v python)"

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Ports of a node's agents: fixed defaults (52365, ...) would clash between two nodes on one machine and
# with any other Ray running here.
node_ports() {
  echo "--node-manager-port=$(free_port) --object-manager-port=$(free_port)" \
    "--dashboard-agent-listen-port=$(free_port) --dashboard-agent-grpc-port=$(free_port)" \
    "--runtime-env-agent-port=$(free_port) --metrics-export-port=$(free_port)"
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for_port() {  # host port seconds
  "$PY" - "$1" "$2" "$3" <<'EOF'
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, port), timeout=2).close()
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
EOF
}

start_node() {  # name log args...
  local name="$1" log="$2"
  shift 2
  # setsid: the node gets its own process group (its pid), which `stop` signals as a whole.
  setsid ray start --block --disable-usage-stats "$@" >"$log" 2>&1 < /dev/null &
  echo $! >"$STATE/$name.pid"
}

start() {
  local with_worker=0
  for arg in "$@"; do
    case "$arg" in
      --worker) with_worker=1 ;;
      *) usage ;;
    esac
  done
  mkdir -p "$STATE"
  # `ray start` turns token authentication on only when a token exists: make sure one does.
  ray get-auth-token --generate >/dev/null
  if alive "$STATE/head.pid"; then
    echo "a head started by this script is already running (pid $(cat "$STATE/head.pid")); stop it first" >&2
    exit 1
  fi
  # shellcheck disable=SC2046 # node_ports prints several flags on purpose
  start_node head "$STATE/head.log" --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
    --port="$RAY_PORT" --dashboard-port="$DASHBOARD_PORT" --ray-client-server-port="$(free_port)" \
    --temp-dir="$STATE/ray" --num-cpus="$HEAD_CPUS" --include-dashboard=true $(node_ports)
  if ! wait_for_port 127.0.0.1 "$DASHBOARD_PORT" 120; then
    echo "the head did not come up; its log:" >&2
    tail -30 "$STATE/head.log" >&2
    stop
    exit 1
  fi
  if [[ $with_worker == 1 ]]; then
    # A joining node turns token authentication on only when told: without it the head refuses it
    # ("InvalidAuthToken") and it retries for ever.
    # shellcheck disable=SC2046
    RAY_AUTH_MODE=token start_node worker "$STATE/worker.log" --address="127.0.0.1:$RAY_PORT" \
      --node-ip-address=127.0.0.1 --num-cpus="$WORKER_CPUS" $(node_ports)
    sleep 5
    alive "$STATE/worker.pid" || { echo "the worker node failed; see $STATE/worker.log" >&2; tail -20 "$STATE/worker.log" >&2; }
  fi
  status
}

status() {
  for name in head worker; do
    if alive "$STATE/$name.pid"; then
      echo "$name    running (process group $(cat "$STATE/$name.pid"), log $STATE/$name.log)"
    elif [[ -f "$STATE/$name.pid" ]]; then
      echo "$name    not running (log $STATE/$name.log)"
    fi
  done
  if alive "$STATE/head.pid"; then
    echo "Jobs API   http://127.0.0.1:$DASHBOARD_PORT   (bigrank submit CONFIG --address http://127.0.0.1:$DASHBOARD_PORT)"
    echo "GCS        127.0.0.1:$RAY_PORT            (bigrank train CONFIG --launcher ray --set ray.address=127.0.0.1:$RAY_PORT)"
    echo "token      ~/.ray/auth_token (read by bigrank; other clients: RAY_AUTH_MODE=token)"
  fi
}

stop_group() {  # pidfile
  local pidfile="$1" pgid
  [[ -f "$pidfile" ]] || return 0
  pgid="$(cat "$pidfile")"
  if kill -0 -- "-$pgid" 2>/dev/null; then
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in $(seq 20); do
      kill -0 -- "-$pgid" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

stop() {
  stop_group "$STATE/worker.pid"
  stop_group "$STATE/head.pid"
  echo "stopped the local Ray cluster of $STATE"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
