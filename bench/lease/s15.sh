# Fifteenth session: issue 18's overlapped prefill, one H200 lease, calls back to back (the
# machine stays warm ~30 s after a call; each call carries at most 64 MiB with the tree).
# `CALL=N bash bench/lease/s15.sh`:
#   1  carry .whl .carry/q1   the GGUF's first part to /root/parts
#   2  carry .carry/q2        its second part
#   3  carry .carry/q3        the GPU tests of the overlapped prefill (fp32, its own stream and
#                             graph lane: they need the GGUF's tokenizer), then C=16 at ~30 and
#                             ~2,900 tokens, each with the admission run: paced (the default:
#                             the chunk beside the decode step, decode at high priority), paced
#                             with DDSERVE_DECODE_PRIORITY=0, paced-serial (--overlap-prefill off)
#   4  (nothing)              capped (2,048 tokens a round) and capped-serial; then the
#                             admission run three times on one engine, paced and paced-serial
# Results straight under $OUT (at most three folders deep; at most a few dozen files a call:
# more are left out, by count).
mkdir -p /root/parts
cp .carry/q?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
py=python3
. bench/common.sh  # wait_url
R=$OUT
lc() {  # DIR PART [env...]: one long_context.sh part, its rows, 3 of its scheduler lines, its chunk gauge
    LENGTHS=30,2900 LEVELS=16 REQ=64 timeout 200 bash bench/long_context.sh $R/$1 $2 2>&1 |
        grep -E "p30 |p2900 |ttft|p99_over|done"
    grep -h "Decode batch" $R/$1/$2-engine.log | grep prefill | awk 'NR%5==0' | tail -3 | cut -c 90-300
    grep -h "^ddserve:prefill_chunk_tokens" $R/$1/$2-p2900.prom
    rm -rf $R/$1/$2-p30 $R/$1/$2-p2900  # the bench folders: their rows are printed above
}
SECONDS=0
case ${CALL:?} in
1 | 2) ls -la /root/parts ;;
3)
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_static_engine.py \
        -k "long_prompt_is_admitted and cuda" 2>&1 | tail -3
    lc lc16 paced
    DDSERVE_DECODE_PRIORITY=0 lc lc16np paced
    lc lc16 paced-serial
    ;;
4)
    for part in capped capped-serial; do ADMIT=0 lc lc16 $part; done
    for part in paced paced-serial; do
        f="--chunked-prefill-size 2048 --chunked-prefill-steps 1.5"
        [ $part = paced-serial ] && f="$f --overlap-prefill off"
        # shellcheck disable=SC2086
        python3 -m ddserve engine --port 30112 --device cuda --drafter none --max-batch 16 \
            --max-context 8192 $f >$R/adm-$part.log 2>&1 &
        pid=$!
        wait_url http://127.0.0.1:30112 $pid
        for i in 1 2 3; do
            timeout 60 python3 -m ddserve.bench.admission --url http://127.0.0.1:30112 \
                --out $R/adm-$part-$i.json 2>&1 | grep -E "long_ttft|p99_over|Error"
        done
        kill $pid; wait $pid
    done
    ;;
esac
echo "call $CALL done at ${SECONDS}s"
