#!/usr/bin/env bash
# `ddserve bench` against a freshly started `ddserve engine` (the HTTP server), then stop it:
#   bench/served.sh OUT_DIR "ENGINE FLAGS" "BENCH FLAGS"
# e.g. bench/served.sh /tmp/served "--device cuda --drafter dflash --budget 16 --topk 4 --max-batch 64" \
#        "--concurrency 1,16,64 --requests 64 --max-tokens 128 --prompts mixed"
# Readiness is the server answering /v1/models (after load, graph capture and warm-up).
set -u
out=$1 engine_flags=$2 bench_flags=$3
port=${PORT:-30111}
py=${PYTHON:-python3}
mkdir -p "$out"
SECONDS=0
# shellcheck disable=SC2086
$py -m ddserve engine --port "$port" $engine_flags >"$out/engine.log" 2>&1 &
pid=$!
if ! $py - "$port" <<'PY'
import sys, time, httpx
url = f"http://127.0.0.1:{sys.argv[1]}/v1/models"
for _ in range(600):
    try:
        httpx.get(url, timeout=1).raise_for_status()
        sys.exit(0)
    except httpx.HTTPError:
        time.sleep(0.5)
sys.exit(1)
PY
then
    echo "engine did not come up; last log lines:" >&2
    tail -5 "$out/engine.log" >&2
    kill "$pid" 2>/dev/null
    exit 1
fi
echo "engine ready after ${SECONDS}s"
# shellcheck disable=SC2086
$py -m ddserve bench --url "http://127.0.0.1:$port" --out "$out" --no-progress $bench_flags
rc=$?
kill "$pid"
wait "$pid" 2>/dev/null
exit $rc
