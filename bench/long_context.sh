#!/usr/bin/env bash
# Long prompts through `ddserve engine` (issue 18), side by side in one run: the same engine
# (SmolLM2-135M, AR: drafter none) served twice,
#   before  --attention-backend sdpa   --chunked-prefill-size -1 --chunked-prefill-steps 0 (the padded-range reference,
#           prompts prefilled whole: the engine before issue 18; since 2026-12-02 its prompt
#           chunks of shapes not captured at warm-up take torch's fused kernels too)
#   after   --attention-backend triton --chunked-prefill-size 2048 (the defaults on a GPU)
# each measured with `ddserve bench` at C=1 and C=16 for synthetic prompts of ~30, ~1,000,
# ~2,900 and ~7,200 tokens (128-token answers), then bench/admission.py (15 running streams
# while a ~7,200-token prompt arrives).
# Two more parts compare the admission policy alone (the default attention of the device):
#   capped  --chunked-prefill-size 2048 --chunked-prefill-steps 0   (a fixed token cap)
#   paced   --chunked-prefill-size 2048 --chunked-prefill-steps STEPS (chunks paced by time; STEPS
#           1.5 unless set: the default)
# and each with --overlap-prefill off (the chunk before the decode step, not beside it):
#   capped-serial, paced-serial
#
#   bench/long_context.sh OUT [before] [after] [capped] [paced] [capped-serial] [paced-serial]
# env: PY (python3), DEVICE (cuda), LENGTHS (30,1000,2900,7200; "" = admission only),
#      LEVELS (1,16), REQ (32), MAXB (16), ADMISSION_ARGS (flags of bench/admission.py),
#      STEPS (paced: --chunked-prefill-steps, 1.5), ADMIT (0: no admission run)
set -u
out=$1
shift
parts=${*:-before after}
py=${PY:-python3}
device=${DEVICE:-cuda}
lengths=${LENGTHS-30,1000,2900,7200}
levels=${LEVELS:-1,16}
req=${REQ:-32}
maxb=${MAXB:-16}
admission_args=${ADMISSION_ARGS:-}
mkdir -p "$out"

source "$(dirname "$0")/common.sh"  # wait_url

for part in $parts; do
    SECONDS=0
    case $part in
    before) flags="--attention-backend sdpa --chunked-prefill-size -1 --chunked-prefill-steps 0" ;;
    after) flags="--attention-backend triton --chunked-prefill-size 2048" ;;
    capped) flags="--chunked-prefill-size 2048 --chunked-prefill-steps 0" ;;
    paced) flags="--chunked-prefill-size 2048 --chunked-prefill-steps ${STEPS:-1.5}" ;;
    capped-serial) flags="--chunked-prefill-size 2048 --chunked-prefill-steps 0 --overlap-prefill off" ;;
    paced-serial) flags="--chunked-prefill-size 2048 --chunked-prefill-steps ${STEPS:-1.5} --overlap-prefill off" ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
    port=30112
    # shellcheck disable=SC2086
    $py -m ddserve engine --port $port --device "$device" --drafter none --max-batch "$maxb" \
        --max-context 8192 $flags >"$out/$part-engine.log" 2>&1 &
    pid=$!
    if wait_url "http://127.0.0.1:$port" "$pid"; then
        echo "$part: engine ready after ${SECONDS}s ($flags)"
        for n in ${lengths//,/ }; do
            $py -m ddserve bench --url "http://127.0.0.1:$port" --out "$out/$part-p$n" \
                --concurrency "$levels" --requests "$req" --max-tokens 128 --prompt-tokens "$n" \
                --no-progress | grep -E "^ +[0-9]+ " | sed "s/^/$part p$n /"
            # the server's counters after this length (TTFT split into queue, prefill and
            # the API's share: the request phase histograms, cumulative over the lengths)
            curl -sf -m 5 "http://127.0.0.1:$port/metrics" >"$out/$part-p$n.prom" 2>/dev/null ||
                rm -f "$out/$part-p$n.prom"
        done
        # shellcheck disable=SC2086
        [ "${ADMIT:-1}" = 0 ] || $py -m ddserve.bench.admission --url "http://127.0.0.1:$port" \
            $admission_args --out "$out/$part-admission.json" |
            grep -E "ttft|p99_over|max_over|running|longest"
    else
        echo "$part: engine did not come up"; tail -5 "$out/$part-engine.log"
    fi
    kill $pid; wait $pid 2>/dev/null
    echo "$part done in ${SECONDS}s"
done
