#!/usr/bin/env bash
# N `ft serve` replicas behind one prefix-cache-aware router (sglang-router), started and stopped by one command.
#
#   scripts/serve_replicas.sh [--replicas N] [--port P] [--host H] [--policy POLICY] [--api-key KEY]
#       [--router-bin PATH] [--router-metrics-port M] [--router-arg ARG ...] [--log-dir DIR] [--startup-timeout S]
#       [-- FT_SERVE_ARGS...]
#
#   scripts/serve_replicas.sh --replicas 2 --port 8000 -- --max-running-requests 8   # the bundled pair, twice
#   scripts/serve_replicas.sh --replicas 4 -- --model runs/tiny-moe --speculative-algorithm dflash \
#       --speculative-draft-model-path runs/tiny-moe-dflash2
#
# Replica i (0-based) is `ft serve FT_SERVE_ARGS --host H --port P+1+i`: the same model, engine and server flags
# for every replica, its log in DIR/replica-i.log. Once every replica answers /health, the router starts on H:P
# (default 127.0.0.1:8000) with --policy cache_aware (default; random or round_robin to compare),
# and once it lists every replica as healthy the script prints its URL. Clients use the router as they would one
# `ft serve`: http://H:P/v1/chat/completions, /v1/completions, /v1/models. Ctrl-C or SIGTERM stops the router,
# then the replicas (each drains its running requests, ft serve --drain-timeout), and exits 0. --api-key KEY
# goes to the router (clients send Authorization: Bearer KEY to it; it passes the header on) and every replica.
# On a CPU machine each replica gets its share of the cores (OMP_NUM_THREADS = cores / N unless set).
#
# The router is sglang-router from PyPI (tested: 0.3.2, `pip install sglang-router`, best in a venv of its own;
# `pip install -e '.[router]'` puts it beside the project). --router-bin or $SGLANG_ROUTER names its executable,
# else the one on PATH, else the one beside the project's python. Its cache_aware policy keeps one approximate
# radix tree of request texts (prompt text, or the chat messages' contents) per replica: a request whose text
# matches a replica's tree for more than --cache-threshold (0.3) of its characters goes there (the replica whose
# prefix cache holds the conversation so far), any other to the least-loaded replica, and every request to the
# least-loaded one while the loads differ by more than 64 requests and 1.5x. The tree holds the prompts it
# routed, not the replies: a second turn matches its first turn's prompt only, so a first prompt much shorter
# than its reply plus the next message can fall under the threshold (--router-arg --cache-threshold
# --router-arg 0.1). A system prompt every conversation shares, longer than the threshold, sends every new
# conversation to one replica until the loads drift apart. The router refuses token-id prompts (422): send text
# or chat messages through it. Its own endpoints: /workers (the replicas and their health), /health, Prometheus
# metrics on --router-metrics-port (default 29000); each replica's /metrics (prefix-cache queries and hits,
# tokens, latencies) stays on its own port. What it reads from a replica: /health (polled), /server_info and
# /model_info (the served model's name, once, when the replica registers).
# vllm-router (PyPI, tested 0.1.17) proxies the same endpoints, but its cache_aware policy asks each replica to
# tokenize the request first (vLLM's /v1/completions/render and /v1/chat/completions/render, which ft serve does
# not serve) and without them routes every request to one replica; hence sglang-router.
#
# Several hosts: nothing here is tied to one machine. On each GPU host run one `ft serve` per GPU (or per host):
#   ft serve --host 0.0.0.0 --port 8001 [the same model and engine flags on every host]
# and on any host that reaches them (one of them, or a CPU-only front end) the router:
#   sglang-router launch --host 0.0.0.0 --port 8000 --policy cache_aware \
#       --worker-urls http://hostA:8001 http://hostB:8001 http://hostC:8001
# which is the router command this script runs, with other hosts' URLs. Replicas can join or leave a running
# router: POST /workers with {"url": "http://hostD:8001"}, DELETE /workers/<id> (GET /workers lists them). With
# --api-key KEY on the replicas, start the router with --api-key KEY too. ft serve binds 127.0.0.1 unless
# --host says otherwise: a replica the router reaches over the network needs --host 0.0.0.0 (or its address) on
# a network that only the router and its operators can reach. The prefix caches stay per replica: affinity is
# what keeps a conversation's turns where its prefix is.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
replicas=2
port=8000
host=127.0.0.1
policy=cache_aware
router_bin="${SGLANG_ROUTER:-}"
router_metrics_port=29000
log_dir=""
api_key=""
router_args=()
serve_args=()
startup_timeout=900

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "serve_replicas.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --replicas) replicas="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        --policy) policy="$2"; shift 2 ;;
        --api-key) api_key="$2"; shift 2 ;;
        --router-bin) router_bin="$2"; shift 2 ;;
        --router-metrics-port) router_metrics_port="$2"; shift 2 ;;
        --router-arg) router_args+=("$2"); shift 2 ;;
        --log-dir) log_dir="$2"; shift 2 ;;
        --startup-timeout) startup_timeout="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; serve_args=("$@"); break ;;
        *) die "unknown option $1 (ft serve flags go after --; --help)" ;;
    esac
done

[[ "$replicas" =~ ^[1-9][0-9]*$ ]] || die "--replicas $replicas: expected an integer >= 1"
[[ "$port" =~ ^[0-9]+$ ]] && (( port >= 1 && port + replicas <= 65535 )) ||
    die "--port $port: expected a port with room for $replicas replicas above it"
for arg in "${serve_args[@]+"${serve_args[@]}"}"; do
    case "$arg" in
        --port|--port=*|--host|--host=*|--api-key|--api-key=*)
            die "ft serve $arg: the script sets each replica's --host, --port and --api-key (use its own)" ;;
    esac
done

# the project's python (for ft and the health checks)
if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x "$here/.venv/bin/python" ]]; then py="$here/.venv/bin/python"
else py="$(command -v python3)"; fi
if [[ -z "$router_bin" ]]; then
    if command -v sglang-router >/dev/null 2>&1; then router_bin="$(command -v sglang-router)"
    elif [[ -x "$(dirname "$py")/sglang-router" ]]; then router_bin="$(dirname "$py")/sglang-router"
    else die "no sglang-router: pip install sglang-router (in a venv of its own, say), then --router-bin PATH"; fi
fi
[[ -x "$router_bin" ]] || router_bin="$(command -v "$router_bin" 2>/dev/null)" || die "--router-bin: not an executable"
[[ -n "$log_dir" ]] || log_dir="$(mktemp -d "${TMPDIR:-/tmp}/ft-replicas.XXXXXX")"
mkdir -p "$log_dir"

# the address clients and the router use to reach a replica
connect_host="$host"
[[ "$host" == "0.0.0.0" || "$host" == "::" ]] && connect_host=127.0.0.1

pids=()
router_pid=""
stopping=0
stop_all() {
    (( stopping )) && return
    stopping=1
    trap '' INT TERM
    if [[ -n "$router_pid" ]] && kill -0 "$router_pid" 2>/dev/null; then
        kill -TERM "$router_pid" 2>/dev/null || true
        wait "$router_pid" 2>/dev/null || true
    fi
    for pid in "${pids[@]+"${pids[@]}"}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" 2>/dev/null || true; done
    echo "stopped: router and $replicas replicas (logs in $log_dir)"
}
trap 'stop_all; exit 0' INT TERM  # asked to stop, and stopped: status 0, as ft serve's drained shutdown
trap 'stop_all' EXIT

http_ok() {  # http_ok URL [healthy-workers]: 0 when URL answers 200 (and lists that many healthy workers)
    API_KEY="$api_key" "$py" - "$@" <<'EOF'
import json, os, sys, urllib.request
request = urllib.request.Request(sys.argv[1])
if os.environ.get("API_KEY"):
    request.add_header("Authorization", "Bearer " + os.environ["API_KEY"])
try:
    with urllib.request.urlopen(request, timeout=5) as r:
        body = r.read()
        ok = r.status == 200
    if ok and len(sys.argv) > 2:
        workers = json.loads(body).get("workers", [])
        ok = sum(1 for w in workers if w.get("is_healthy")) >= int(sys.argv[2])
except Exception:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

# CPU threads: each replica's share of this machine's cores unless OMP_NUM_THREADS says otherwise (replicas that
# each take every core thrash: two bundled-pair replicas on 2 cores warm up in minutes instead of seconds)
cores="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / replicas > 0 ? cores / replicas : 1 ))}"
echo "replicas: $replicas, $OMP_NUM_THREADS CPU threads each (OMP_NUM_THREADS)"

# job control: every replica and the router in a process group of its own, so a Ctrl-C at the terminal reaches
# this script alone, which then stops each of them once (a second signal would cut ft serve's drain short)
set -m
urls=()
key_args=()
[[ -z "$api_key" ]] || key_args=(--api-key "$api_key")
for ((i = 0; i < replicas; i++)); do
    p=$((port + 1 + i))
    urls+=("http://$connect_host:$p")
    TOKENIZERS_PARALLELISM=false "$py" -m dflash2.cli serve "${serve_args[@]+"${serve_args[@]}"}" \
        --host "$host" --port "$p" "${key_args[@]+"${key_args[@]}"}" >"$log_dir/replica-$i.log" 2>&1 &
    pids+=($!)
    echo "replica $i: ${urls[$i]} (pid ${pids[$i]}, log $log_dir/replica-$i.log)"
done

deadline=$((SECONDS + startup_timeout))
for ((i = 0; i < replicas; i++)); do
    until http_ok "${urls[$i]}/health"; do
        kill -0 "${pids[$i]}" 2>/dev/null ||
            { tail -n 20 "$log_dir/replica-$i.log" >&2; die "replica $i exited before it listened"; }
        (( SECONDS < deadline )) || die "replica $i did not answer /health within ${startup_timeout} s"
        sleep 1
    done
done
echo "replicas ready: ${urls[*]}"

"$router_bin" launch --host "$host" --port "$port" --worker-urls "${urls[@]}" --policy "$policy" \
    --prometheus-port "$router_metrics_port" --log-level warn "${key_args[@]+"${key_args[@]}"}" \
    "${router_args[@]+"${router_args[@]}"}" \
    >"$log_dir/router.log" 2>&1 &
router_pid=$!
router_url="http://$connect_host:$port"
until http_ok "$router_url/workers" "$replicas"; do
    kill -0 "$router_pid" 2>/dev/null || { tail -n 20 "$log_dir/router.log" >&2; die "the router exited"; }
    (( SECONDS < deadline )) || die "the router did not list $replicas healthy replicas within ${startup_timeout} s"
    sleep 1
done
echo "router: $router_url (policy $policy, $replicas replicas, log $log_dir/router.log, metrics :$router_metrics_port)"
echo "ready: OpenAI API at $router_url/v1; Ctrl-C stops everything"

# stay up until a replica or the router exits (or a signal comes)
while :; do
    kill -0 "$router_pid" 2>/dev/null || { echo "the router exited" >&2; exit 1; }
    for ((i = 0; i < replicas; i++)); do
        kill -0 "${pids[$i]}" 2>/dev/null || { echo "replica $i exited" >&2; exit 1; }
    done
    sleep 1 &
    wait $! || true
done
