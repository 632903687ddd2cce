# Seventeenth session: one H200 lease, calls back to back (the machine stays warm ~30 s after a
# call; each call carries at most 64 MiB with the tree). `CALL=N bash bench/lease/s17.sh`:
#   1  carry .whl .carry/q1   the GGUF's first part; GPU tests that need no tokenizer (fused
#                             layers, attention kernels, the static engine's CUDA tests): the
#                             fifteenth session's review fixes (filler rows, lane streams, a
#                             failed chunk's join) never ran on a GPU
#   2  carry .carry/q2        the GGUF's second part; the GPU tree build's tests
#   3  carry .carry/q3        the tokenizer's pieces by size on this host (eighteenth session);
#                             the overlapped prefill's GPU tests (they need the GGUF's
#                             tokenizer), then C=16 at ~30 and ~2,900 tokens with the admission
#                             run: paced (the default, with the sixteenth session's step-time
#                             refresh), the same with DDSERVE_DECODE_PRIORITY=0, paced-serial
#   4  (nothing)              a ~7,200-token prompt's TTFT at C=1 (paced, the default); the
#                             admission run three times on one engine, paced and paced-serial
#   5  (after 1-3's carries)  a ~7,200-token prompt's TTFT with the tokenizer's pieces of at
#                             least 4,096 and 2,048 characters, twice each
# CALL=0 copies the carried parts, nothing else; SKIP_NP=1 leaves call 3's no-priority part out.
# Results under $OUT (at most three folders deep, a few dozen files a call).
mkdir -p /root/parts
cp .carry/q?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
py=python3
. bench/common.sh  # wait_url
R=$OUT
quiet() { grep -v -E 'Warn|transformers|^ *$'; }
lc() {  # DIR PART [env...]: one long_context.sh part, its rows, 3 of its scheduler lines, its chunk gauge
    LENGTHS=${LENGTHS:-30,2900} LEVELS=${LEVELS:-16} REQ=${REQ:-64} timeout 220 bash bench/long_context.sh $R/$1 $2 2>&1 |
        grep -E "p30 |p2900 |p7200 |ttft|p99_over|done"
    grep -h "Decode batch" $R/$1/$2-engine.log | grep prefill | awk 'NR%5==0' | tail -3 | cut -c 90-300
    grep -h "^ddserve:prefill_chunk_tokens\|^ddserve:time_to_first_token_seconds_sum\|^ddserve:request_prefill_time_seconds_sum" $R/$1/$2-p*.prom
    rm -rf $R/$1/$2-p30 $R/$1/$2-p2900 $R/$1/$2-p7200  # the bench folders: their rows are printed above
}
SECONDS=0
case ${CALL:?} in
1)
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_attention.py tests/engine/test_static_engine.py \
        -k "(cuda or triton or pdl or attention or filler or fill) and not long_prompt" >$R/gpu_tests_1.txt 2>&1
    tail -2 $R/gpu_tests_1.txt
    grep -E "^FAILED|^ERROR" $R/gpu_tests_1.txt | head -8
    ;;
2)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py >$R/gpu_tests_2.txt 2>&1
    tail -2 $R/gpu_tests_2.txt
    grep -E "^FAILED|^ERROR" $R/gpu_tests_2.txt | head -8
    ;;
3)
    python3 -m ddserve.bench.tokenizer_probe --piece-chars 4096,2048,1024,512 2>&1 | grep -v Warn
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_static_engine.py \
        -k "long_prompt_is_admitted and cuda" 2>&1 | tail -3
    lc lc16 paced
    [ -n "${SKIP_NP:-}" ] || DDSERVE_DECODE_PRIORITY=0 lc lc16np paced
    lc lc16 paced-serial
    ;;
4)
    ADMIT=0 LENGTHS=7200 LEVELS=1 REQ=32 lc ttft paced
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
5)  # the tokenizer's piece size, old and new, twice each on this machine (eighteenth session)
    for size in 4096 2048 4096 2048; do
        sed -i "s/^PIECE_CHARS = .*/PIECE_CHARS = $size/" service/api/pieces.py
        echo "PIECE_CHARS $size"
        ADMIT=0 LENGTHS=7200 LEVELS=1 REQ=32 lc ttft-$size paced | grep -E "p7200|done"
    done
    ;;
esac
echo "call $CALL done at ${SECONDS}s"
