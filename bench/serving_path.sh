#!/usr/bin/env bash
# The serving path side by side, one machine, one run (issue 13): the same engine config
# (SmolLM2-135M + its DFlash drafter, budget 16 / topk 4 and budget 0 = AR, spec_max_batch 2)
# measured three ways at the same concurrency levels, the same prompts and answer lengths:
#   inproc  the engine runner in the load generator's process (no HTTP): python -m ddserve.bench.engine_load
#   http    `ddserve engine` (API process + engine core process) + `ddserve bench`
#   http-asc  the same with `--api-server-count $API_SERVERS` (4): API processes over one core
#   ray     `ddserve up` (Serve, one replica; http.ingress proxy and haproxy) + `ddserve bench`
#   ray-asc   `ddserve up` with the HAProxy ingress and `api_server_count: $API_SERVERS` (4):
#             the replica's API processes over its one engine core
#   http-deploy  `ddserve engine --config $DEPLOY` (default deploy/smollm2-gpu.yaml: the
#             shipped GPU config, adaptive speculation, rounds a trip; its api_server_count
#             too), budgets of $BUDGETS set through /admin/params (with adaptive speculation:
#             its ceiling: BUDGETS="15 0" for the shipped file)
#   ray-deploy   `ddserve up --config $DEPLOY`, budgets through `ddserve reconfig set`
#             (both deploy legs take the file's device and max_batch: DEVICE and MAXB are
#             not theirs; LEVELS past its max_batch queue)
# AR is the same engine with budget 0 (`/admin/params`, `ddserve reconfig set`), so every
# path runs the same weights and graphs.
#
#   bench/serving_path.sh OUT [inproc] [http] [http-asc] [http-ref] [ray-proxy] [ray-haproxy] [ray-asc]
#                             [http-deploy] [ray-deploy]
# env: PY (python), LEVELS (1,16,64,128), REQ (requests per level, at least WAVES x C is used;
#      WAVES: 2),
#      DEVICE (cuda), MAXB (KV slots: the largest level), PROMPTS (mixed),
#      BUDGETS ("16 0": DDTree b16/k4, then AR; "0": AR only),
#      REF_PYTHONPATH (http-ref: `ddserve engine` from another checkout's import root, e.g. the
#      code before a change, measured in the same run as http)
# then: python -m ddserve.bench.serving_path_report OUT   (table, JSON, PNG)
set -u
out=$1
shift
parts=${*:-inproc http ray-proxy ray-haproxy}
py=${PY:-python3}
levels=${LEVELS:-1,16,64,128}
req=${REQ:-128}
device=${DEVICE:-cuda}
maxb=${MAXB:-128}
prompts=${PROMPTS:-mixed}
tokens=${TOKENS:-128}
budgets=${BUDGETS:-16 0}
waves=${WAVES:-2}
deploy=${DEPLOY:-deploy/smollm2-gpu.yaml}
export DDSERVE_ADMIN_TOKEN=${DDSERVE_ADMIN_TOKEN:-serving-path-bench}
mkdir -p "$out"

bench_levels() {  # URL OUTDIR: one `ddserve bench` per level, max(REQ, WAVES x C) requests
    # each (as engine_load counts them), so every path measures the same number per level
    for c in ${levels//,/ }; do
        n=$((waves * c > req ? waves * c : req))
        $py -m ddserve bench --url "$1" --out "$2-C$c" --concurrency "$c" --requests "$n" \
            --max-tokens "$tokens" --prompts "$prompts" --no-progress | grep -E "^ +$c "
        # the server's own histograms after the level (cumulative: TTFT seen by the API
        # process next to the client's), where the URL serves them
        curl -sf -m 5 "$1/metrics" >"$2-C$c.prom" 2>/dev/null || rm -f "$2-C$c.prom"
    done
}

source "$(dirname "$0")/common.sh"  # wait_url, ray_up, ray_down

for part in $parts; do
    SECONDS=0
    case $part in
    inproc)
        configs=$(for b in $budgets; do [ "$b" = 0 ] && echo dflash-b0 || echo "dflash-b${b}k4"; done | paste -sd,)
        $py -m ddserve.bench.engine_load --device "$device" --configs "$configs" \
            --spec-max-batch 2 --concurrency "$levels" --requests "$req" --waves "$waves" --max-tokens "$tokens" \
            --prompt-set "$prompts" --name inproc --out "$out"
        ;;
    http | http-ref | http-asc | http-deploy)
        port=30111
        pp=${PYTHONPATH:-}
        [ $part = http-ref ] && pp=${REF_PYTHONPATH:?http-ref needs REF_PYTHONPATH}:$pp
        flags=(--device "$device" --drafter dflash --budget 16 --topk 4 --max-batch "$maxb" --spec-max-batch 2)
        [ $part = http-asc ] && flags+=(--api-server-count "${API_SERVERS:-4}")
        [ $part = http-deploy ] && flags=(--config "$deploy")
        PYTHONPATH=$pp $py -m ddserve engine --port $port "${flags[@]}" >"$out/$part-engine.log" 2>&1 &
        pid=$!
        if wait_url "http://127.0.0.1:$port" "$pid"; then
            echo "$part: engine ready after ${SECONDS}s"
            for b in $budgets; do  # every leg sets its budget (whatever the order)
                $py - $port "$b" <<'PY'
import os, sys, httpx
r = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/admin/params", json={"budget": int(sys.argv[2])},
               headers={"Authorization": "Bearer " + os.environ["DDSERVE_ADMIN_TOKEN"]})
print("budget", sys.argv[2], r.status_code, r.text[:200])
PY
                name=$([ "$b" = 0 ] && echo b0 || echo "b${b}k4")
                bench_levels "http://127.0.0.1:$port" "$out/$part-$name"
            done
        else
            echo "$part: engine did not come up"; tail -5 "$out/$part-engine.log"
        fi
        kill $pid; wait $pid 2>/dev/null
        ;;
    ray-proxy | ray-haproxy | ray-asc | ray-deploy)
        ingress=${part#ray-}
        apis=1
        [ $part = ray-asc ] && ingress=haproxy apis=${API_SERVERS:-4}
        cfg="$out/$part.yaml"
        if [ $part = ray-deploy ]; then
            cp "$deploy" "$cfg"
        else
            cat >"$cfg" <<EOF
name: bench
engine:
  kind: builtin
  model: smollm2-135m
  drafter: {kind: dflash, depth: 8}
  params: {budget: 16, topk: 4, window: 2048, temperature: 0.0, top_p: 1.0, top_k: 0}
  device: $device
  max_batch: $maxb
  spec_max_batch: 2
replicas: 1
max_ongoing_requests: $((2 * maxb))
api_server_count: $apis
cpus_per_replica: $((apis + 1))
http: {host: 127.0.0.1, port: 8000, ingress: $ingress}
health: {period_s: 10, timeout_s: 120, recent_traffic_s: 10, engine_start_timeout_s: 900}
EOF
        fi
        if ray_up "$part" "$cfg" "$out/$part-up.log"; then
            echo "$part: ready after ${SECONDS}s"
            for b in $budgets; do  # each leg sets its budget through the reconfig controller
                $py -m ddserve reconfig set "budget=$b" --config "$cfg" >>"$out/$part-up.log" 2>&1
                name=$([ "$b" = 0 ] && echo b0 || echo "b${b}k4")
                bench_levels http://127.0.0.1:8000 "$out/$part-$name"
            done
        fi
        ray_down "$cfg" "$out/$part-up.log"
        ;;
    esac
    echo "$part done in ${SECONDS}s"
done
