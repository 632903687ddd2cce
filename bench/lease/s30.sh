# Twenty-seventh session: several DDTree rounds a host round trip (engine/static_spec.py,
# --num-scheduler-steps with DFlash), and the multi-step rounds s29.sh left unmeasured. One
# lease, calls back to back on one machine (it goes back 30 s after a call).
# `CALL=N bash bench/lease/s30.sh`:
#   1  carry .whl .carry/r1   GPU tests: rounds on the device (greedy fp32 under graphs == the
#                   reference, seeded samples == one-round rounds), several plain steps a
#                   round (the same); a round by phase on random SmolLM2 weights (wall, GPU
#                   busy, the host's exposed time) at B 1 (BATCHES): AR 1 / 4 steps, b15/k4 1 /
#                   4 / 8 rounds a trip
#   2  carry .carry/r2        the GGUF's second part
#   3  carry .carry/r3        the real weights at C=1 in-process (16 held-out prompts, 128
#                   tokens, bf16): AR 1 / 4 steps, DDTree b15/k4 1 / 4 / 8 rounds a trip;
#                   fp32: AR and b15/k4 at 4 rounds, the same answers (lossless column);
#                   the served path: `ddserve engine` + `ddserve bench` at C=1 and 4, b15/k4
#                   with --num-scheduler-steps 1 and 4
#   4  (nothing)              if device time is left: load levels through the in-process
#                   runner (C 1/2/16/64, 128 tokens, ignore_eos): AR at 1 and 4 steps, b15/k4
#                   adaptive at 1 and 4 rounds a trip (issue 14's "never slower than AR")
#   5  (nothing)              the bf16 C=1 configs once more, b15/k4 at 4 and 8 rounds with the
#                   rounds' glue compiled (SPEC_GLUE_COMPILED), the served path without a
#                   drafter at 1 and 4 steps
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null  # the GGUF in three parts, .carry/r1..r3
. bench/device_env.sh /root/parts
quiet() { grep -v -e transformers -e Convert -e Loading -e '^  ' -e Warning -e warn; }
C1=ar,dflash-b15k4,ar@steps4,dflash-b15k4@steps4,dflash-b15k4@steps8  # new paths last
c1() {  # NAME: the C=1 configs in-process
    timeout 220 python3 -m ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 \
        --max-tokens 128 --configs $C1 --sampled-configs "" --no-server --name "$1" \
        --out $OUT 2>&1 | quiet | tail -7
    echo "$1: ${SECONDS}s"
}
served() {  # DRAFTER FLAGS: `ddserve engine` at 1 and 4 steps a trip, `ddserve bench` C=1, 4
    for s in 1 4; do
        name=served-$(echo $1 | cut -d' ' -f1)-s$s
        timeout 100 bash bench/served.sh /root/$name \
            "--device cuda --drafter $1 --max-batch 4 --num-scheduler-steps $s" \
            "--concurrency 1,4 --requests 24 --max-tokens 128 --prompts chat" 2>&1 |
            grep -E "^ +[14] |ready|error|Error" | cut -c1-150 | sed "s/^/$name /"
        cp /root/$name/bench.json $OUT/$name.json 2>/dev/null
        echo "$name: ${SECONDS}s"
    done
}
case ${CALL:?} in
1)
    timeout ${PROFILE_S:-200} python3 -m ddserve.bench.round_profile --model random-smollm2 \
        --device cuda --configs ${PROFILE:-ar,dflash-b15k4,ar@steps4,dflash-b15k4@steps4,dflash-b15k4@steps8} \
        --batches ${BATCHES:-1} --rounds 40 --kernels 10 --name rp-random --out $OUT 2>&1 |
        grep -e "^[ad][a-z0-9@-]* " -e "GPU:" -e Error -e error | cut -c1-120
    echo "profile: ${SECONDS}s"
    timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -x \
        tests/engine/test_spec_steps.py tests/engine/test_scheduler_steps.py -k cuda \
        2>&1 | tail -4 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    ;;
2) ls -la /root/parts | tail -3 ;;
3)
    c1 c1-r1
    timeout 120 python3 -m ddserve.bench.engine_cpu --device cuda --dtype float32 \
        --prompt-set heldout:16 --max-tokens 128 --configs ar,dflash-b15k4@steps4 \
        --sampled-configs "" --no-server --name fp32 --out $OUT 2>&1 | quiet | tail -3
    echo "fp32: ${SECONDS}s"
    served "dflash --budget 15 --topk 4"
    ;;
4)
    timeout ${LOAD_S:-400} python3 -m ddserve.bench.engine_load --device cuda \
        --configs ${LOAD:-ar,ar@steps4,dflash-b15k4@adaptive,dflash-b15k4@adaptive@steps4} \
        --concurrency ${LEVELS:-1,2,16,64} --requests 32 --waves ${WAVES:-4} --max-tokens 128 \
        --prompt-set heldout:16 --name load --out $OUT 2>&1 | grep -v -e Warning -e warn |
        grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" | cut -c1-120
    echo "load: ${SECONDS}s"
    ;;
5)
    c1 c1-r2
    echo '{"engine": {"SPEC_GLUE_COMPILED": true}}' >/tmp/specc.json  # the glue compiled
    timeout 200 python3 -m ddserve.bench.tuned /tmp/specc.json ddserve.bench.engine_cpu \
        --device cuda --prompt-set heldout:16 --max-tokens 128 \
        --configs dflash-b15k4@steps4,dflash-b15k4@steps8 --sampled-configs "" --no-server \
        --name c1-compiled --out $OUT 2>&1 | quiet | tail -4
    echo "c1-compiled: ${SECONDS}s"
    served none
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
