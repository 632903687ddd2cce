# Twenty-sixth session: what the twenty-fifth left unmeasured (issue 17). One lease, calls back
# to back on one machine (it goes back 30 s after a call). `CALL=N bash bench/lease/s29.sh`:
#   1  carry .whl .carry/r1 .carry/old   GPU tests (split kernels, tree build, compiled glue);
#                   the GPU tree build before (.carry/old = ec72aa5's service/) vs now; a C=1
#                   round by phase on random weights: this tree (split-K default) vs unsplit.json
#   2  carry .carry/r2   each layer kernel alone, its default set at 8 and 16 rows, at
#                   1/2/3/5 splits (layer_kernels); verify steps B 1/4 x W 1/8/16 default vs unsplit.json,
#                   then B 1/2 x W 8/16 default vs layer_kernels' best splits
#   3  carry .carry/r3 .carry/old   the real weights at C=1 (16 held-out prompts, 128 tokens,
#                   bf16): .carry/old, this tree, this tree with unsplit.json, alternated; fp32
#                   greedy == AR; round_profile on the real weights
#   4  carry .whl .carry/tree24   after 1-3: the tree build of ec72aa5 back (the twenty-fourth
#                   session's, .carry/tree24 = 2f1cf29's, measured slower) and split-K by
#                   kernel (qkv, gate/up at 16 rows; gate/up at 8): GPU tests (tree build,
#                   engine), tree_build against tree24, verify steps and C=1 rounds (random
#                   SmolLM2, b7k4 and b15k4) the default against split3.json (the last default)
#   5  carry .whl .carry/r1 .carry/tree24   call 4's tests and measurements in short, and the
#                   GPU tests of several decoding steps a round (static_steps: greedy fp32
#                   under graphs == the reference, seeded samples == one-step rounds)
#   6  carry .carry/r2   the GGUF's second part
#   7  carry .carry/r3   the real weights at C=1: AR one step a round against 4 and 8
#                   (--num-scheduler-steps), b7k4 and b15k4 (split-K by kernel) against
#                   split3.json; fp32: the same answers (lossless column against AR)
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null  # the GGUF in three parts, .carry/r1..r3
L=bench/results/layer-split
if [ -d .carry/old ]; then . bench/lease/old_env.sh; else . bench/device_env.sh /root/parts; fi
quiet() { grep -v -e transformers -e Convert -e Loading -e '^  ' -e Warning -e warn; }
run_v() {  # SECONDS VARIANT MODULE ARGS...: old (.carry/old), new (this tree), uns (unsplit)
    local t=$1 v=$2 pp=/tmp/pp; shift 2
    [ $v = old ] && pp=/tmp/pp-old
    local pre=(-m "$@")
    [ $v = uns ] && pre=(-m ddserve.bench.tuned $L/unsplit.json "$@")
    PYTHONPATH=$pp:/tmp/site:$root timeout $t python3 "${pre[@]}"
}
tree_and_steps() {  # calls 4 and 5: the tree build against tree24, verify steps vs split3.json
    timeout 60 python3 -m ddserve.bench.tree_build --against .carry/tree24/tree_triton.py \
        --out $OUT 2>&1 | tail -8
    timeout 120 python3 -m ddserve.bench.static_step --model random-smollm2 \
        --modes fused,fused+tuned --fused-tune $L/split3.json --attention triton \
        --batches 1,2,8 --widths 1,8,16 --context 256 --name steps-split3 --out $OUT 2>&1 |
        grep -e "^fused" -e Error -e error | cut -c1-110
}
case ${CALL:?} in
1)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_attention.py tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "split or tree or compiled_glue" 2>&1 | tail -4 |
        tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    timeout 60 python3 -m ddserve.bench.tree_build \
        --against .carry/old/service/engine/tree_triton.py --out $OUT 2>&1 | tail -8
    for v in new uns; do
        run_v 100 $v ddserve.bench.round_profile --model random-smollm2 --device cuda \
            --configs dflash-b15k4,ar --batches 1 --rounds 100 --kernels 20 --name rp-$v \
            --out $OUT 2>&1 | quiet
        echo "rp-$v: ${SECONDS}s"
    done
    ;;
2)
    timeout 150 python3 -m ddserve.bench.layer_kernels --rows 8,16 --grids defaults \
        --kernels qkv,gate_up,o,down --splits 1,2,3,5 --verbose --name lk-split --out $OUT 2>&1 |
        grep -e "^rows" | cut -c1-160
    echo "layer_kernels: ${SECONDS}s"
    timeout 120 python3 -m ddserve.bench.static_step --model random-smollm2 \
        --modes fused,fused+tuned --fused-tune $L/unsplit.json --attention triton \
        --batches 1,4 --widths 1,8,16 --context 256 --name steps-unsplit --out $OUT 2>&1 |
        grep -e "^fused" -e Error -e error | cut -c1-110
    # the 8- and 16-row classes at the splits layer_kernels found best, against the default
    timeout 100 python3 -m ddserve.bench.static_step --model random-smollm2 \
        --modes fused,fused+tuned --fused-tune $OUT/lk-split.json --attention triton \
        --batches 1,2 --widths 8,16 --context 256 --name steps-lk --out $OUT 2>&1 |
        grep -e "^fused" -e Error -e error | cut -c1-110
    ls -la /root/parts | tail -3
    ;;
3)
    for r in 1 2; do
        for v in old new uns; do
            run_v 100 $v ddserve.bench.engine_cpu --device cuda --prompt-set heldout:16 \
                --max-tokens 128 --configs ${CONFIGS:-ar,dflash-b15k4} --sampled-configs "" \
                --no-server --name c1-r$r-$v --out $OUT 2>&1 | quiet | tail -4
            echo "c1-r$r-$v: ${SECONDS}s"
        done
    done
    timeout 120 python3 -m ddserve.bench.engine_cpu --device cuda --dtype float32 \
        --prompt-set heldout:16 --max-tokens 128 --configs ar,dflash-b15k4 --sampled-configs "" \
        --no-server --name fp32 --out $OUT 2>&1 | quiet | tail -4
    echo "fp32: ${SECONDS}s"
    timeout 100 python3 -m ddserve.bench.round_profile --device cuda --configs ar,dflash-b15k4 \
        --batches 1 --rounds 100 --kernels 30 --name rp-real --out $OUT 2>&1 | quiet
    ;;
4)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "tree or compiled_glue or split" 2>&1 | tail -3 |
        tee $OUT/gpu_tests_4.txt
    echo "tests: ${SECONDS}s"
    tree_and_steps
    echo "steps: ${SECONDS}s"
    for v in new s3; do
        pre=(-m ddserve.bench.round_profile)
        [ $v = s3 ] && pre=(-m ddserve.bench.tuned $L/split3.json ddserve.bench.round_profile)
        timeout 100 python3 "${pre[@]}" --model random-smollm2 --device cuda \
            --configs dflash-b7k4,dflash-b15k4 --batches 1 --rounds 100 --name rp4-$v \
            --out $OUT 2>&1 | quiet | grep -v "^ "
        echo "rp4-$v: ${SECONDS}s"
    done
    ;;
5)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_scheduler_steps.py \
        tests/engine/test_tree_triton.py 2>&1 | tail -3 | tee $OUT/gpu_tests_5.txt
    echo "tests: ${SECONDS}s"
    tree_and_steps
    ;;
6) ls -la /root/parts | tail -3 ;;
7)
    for v in new s3; do
        pre=(-m ddserve.bench.engine_cpu)
        c=ar,ar@steps4,ar@steps8,dflash-b7k4,dflash-b15k4
        [ $v = s3 ] && pre=(-m ddserve.bench.tuned $L/split3.json ddserve.bench.engine_cpu) &&
            c=ar,dflash-b7k4,dflash-b15k4
        timeout 150 python3 "${pre[@]}" --device cuda --prompt-set heldout:16 --max-tokens 128 \
            --configs $c --sampled-configs "" --no-server --name c1-$v --out $OUT 2>&1 |
            quiet | tail -6
        echo "c1-$v: ${SECONDS}s"
    done
    timeout 150 python3 -m ddserve.bench.engine_cpu --device cuda --dtype float32 \
        --prompt-set heldout:16 --max-tokens 128 --configs ar,ar@steps4,dflash-b7k4 \
        --sampled-configs "" --no-server --name fp32-steps --out $OUT 2>&1 | quiet | tail -4
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
