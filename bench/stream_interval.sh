#!/usr/bin/env bash
# --stream-interval side by side, one machine, one run: the same engine served by `ddserve
# engine` (http) and by `ddserve up` (ray: Serve's proxy, one replica), each at every interval,
# the same load (`ddserve bench`, C concurrent streams); for every leg the client's figures and
# the CPU the whole machine spent per output token (all processes: API, engine core, Ray's
# proxy/replica/GCS, the client; /proc/stat over the bench).
#
#   bench/stream_interval.sh OUT [http] [ray]
# env: PY (python), INTERVALS ("1 4"), C (32), REQ (128), TOKENS (128), PROMPTS (humaneval),
#      MODEL (tiny-random:7), DRAFTER (none), MAXB (64)
# then: python -m ddserve.bench.stream_interval_report OUT   (table, JSON, PNG)
set -u
out=$1
shift
parts=${*:-http ray}
py=${PY:-python3}
intervals=${INTERVALS:-1 4}
c=${C:-32}
req=${REQ:-128}
tokens=${TOKENS:-128}
prompts=${PROMPTS:-humaneval}
model=${MODEL:-tiny-random:7}
drafter=${DRAFTER:-none}
maxb=${MAXB:-64}
mkdir -p "$out"
source "$(dirname "$0")/common.sh"  # wait_url, ray_up, ray_down

busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }  # user nice system irq softirq

measure() {  # URL LEG: one `ddserve bench`, and the machine's CPU jiffies over it
    local b0 b1
    b0=$(busy)
    if $py -m ddserve bench --url "$1" --out "$out/$2" --concurrency "$c" --requests "$req" \
        --max-tokens "$tokens" --prompts "$prompts" --no-progress >"$out/$2.log" 2>&1; then
        b1=$(busy)
        grep -E "^ +$c " "$out/$2.log"
        echo "{\"busy_jiffies\": $((b1 - b0)), \"hz\": $(getconf CLK_TCK)}" >"$out/$2/cpu.json"
    else
        echo "$2: bench failed"; tail -3 "$out/$2.log"
    fi
}

for part in $parts; do
    for n in $intervals; do
        SECONDS=0
        case $part in
        http)
            port=30121
            $py -m ddserve engine --port $port --model "$model" --drafter "$drafter" \
                --max-batch "$maxb" --stream-interval "$n" >"$out/http-i$n-engine.log" 2>&1 &
            pid=$!
            if wait_url "http://127.0.0.1:$port" "$pid"; then
                measure "http://127.0.0.1:$port" "http-i$n"
            else
                echo "http-i$n: engine did not come up"; tail -5 "$out/http-i$n-engine.log"
            fi
            kill $pid; wait $pid 2>/dev/null
            ;;
        ray)
            cfg="$out/ray-i$n.yaml"
            cat >"$cfg" <<YAML
name: streambench
engine: {kind: builtin, model: "$model", drafter: {kind: $drafter}, max_batch: $maxb, stream_interval: $n}
replicas: 1
max_ongoing_requests: $((2 * maxb))
cpus_per_replica: 1
http: {host: 127.0.0.1, port: 8000, ingress: proxy}
health: {period_s: 10, timeout_s: 120, recent_traffic_s: 10, engine_start_timeout_s: 900}
YAML
            if ray_up "ray-i$n" "$cfg" "$out/ray-i$n-up.log"; then
                measure http://127.0.0.1:8000 "ray-i$n"
            fi
            ray_down "$cfg" "$out/ray-i$n-up.log"
            ;;
        esac
        echo "$part-i$n done in ${SECONDS}s"
    done
done
