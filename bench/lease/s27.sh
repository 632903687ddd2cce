# Twenty-fourth session: where a C=1 round's time goes beside the verify step (issues 14/17:
# the engine's verify read 1.55 ms where the step alone takes 1.07), and the round's glue
# compiled, the GPU tree build with no memory access per step. One lease, calls back to back.
# `CALL=N bash bench/lease/s27.sh`:
#   0  carry .whl .carry/old   GPU tests (the tree build; the compiled glue's engine, fp32
#                     under graphs); the GPU tree build before (.carry/old's tree_triton.py) vs now
#                     (`bench.tree_build`); `round_profile --kernels` on random SmolLM2
#                     weights at C=1 (the GPU's time by phase: draft, verify, other; busy
#                     against wall; the costliest kernels), AR and b15k4, the session's start
#                     (.carry/old) against this tree, alternated twice
#   1  carry .whl .carry/r1   (the GGUF's first part) call 0's GPU tests, tree build and
#                     round_profile at C=1 (ar, b15k4), this tree only
#   2  carry .carry/r2    (its second part)
#   3  carry .carry/r3 .carry/old   the real weights: C=1 greedy through the engine (16
#                     held-out prompts, 128 tokens, bf16), the session's start (.carry/old:
#                     `git archive ec72aa5 service | tar -x -C .carry/old
#                     --exclude=service/engine/dflash_weights`) against this tree, alternated
#                     twice; fp32 greedy == AR (this tree); round_profile --kernels at C=1
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null  # the GGUF in three parts, .carry/r1..r3
. bench/device_env.sh /root/parts
R=bench/results/round-profile
rp() {  # NAME CONFIGS BATCHES [TUNED_JSON]
    local pre=(-m ddserve.bench.round_profile)
    [ -n "${4:-}" ] && pre=(-m ddserve.bench.tuned "$4" ddserve.bench.round_profile)
    timeout ${RP_S:-200} python3 "${pre[@]}" --model random-smollm2 --device cuda \
        --configs $2 --batches $3 --rounds 100 --kernels 30 --name $1 --out $OUT 2>&1 |
        grep -v -e Warning -e warn
    echo "$1: ${SECONDS}s"
}
case ${CALL:?} in
tiny)  # carry .whl .carry/old: the tree build before/now and its GPU tests (~2 min)
    timeout 60 python3 -m ddserve.bench.tree_build --against .carry/old/service/engine/tree_triton.py \
        --out $OUT 2>&1 | tail -8
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py 2>&1 |
        tail -3 | tee $OUT/gpu_tests_tree.txt
    ;;
short)  # carry .whl .carry/old: what call 0 measures, the most telling first (a short lease)
    . bench/lease/old_env.sh
    timeout 60 python3 -m ddserve.bench.tree_build \
        --against .carry/old/service/engine/tree_triton.py --out $OUT 2>&1 | tail -8
    for v in new old; do
        pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
        PYTHONPATH=$pp:/tmp/site:$root timeout 100 python3 -m ddserve.bench.round_profile \
            --model random-smollm2 --device cuda --configs dflash-b15k4,ar --batches 1 \
            --rounds 100 --kernels 20 --name rp-$v --out $OUT 2>&1 | grep -v -e Warning -e warn
        echo "rp-$v: ${SECONDS}s"
    done
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "tree or compiled_glue" 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    ;;
0)  # carry .whl .carry/old (the session's start: ec72aa5's service/, as call 3 says)
    . bench/lease/old_env.sh
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "tree or compiled_glue" 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    timeout 100 python3 -m ddserve.bench.tree_build \
        --against .carry/old/service/engine/tree_triton.py --out $OUT 2>&1 | tail -8
    for r in $(seq ${AB:-2}); do  # alternations
        for v in old new; do
            pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
            PYTHONPATH=$pp:/tmp/site:$root timeout 150 python3 -m ddserve.bench.round_profile \
                --model random-smollm2 --device cuda --configs ${CONFIGS:-ar,dflash-b15k4} \
                --batches 1 --rounds 100 --kernels 30 --name rp-r$r-$v --out $OUT 2>&1 |
                grep -v -e Warning -e warn
            echo "rp-r$r-$v: ${SECONDS}s"
        done
    done
    ;;
1)  # carry .whl .carry/q1 (the short plan: call 0's essentials while the GGUF goes over)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "tree or compiled_glue" 2>&1 |
        tail -4 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    timeout 100 python3 -m ddserve.bench.tree_build --against .carry/old/service/engine/tree_triton.py \
        --out $OUT 2>&1 | tail -8
    RP_S=150 rp rp-random ar,dflash-b15k4 1
    ;;
2) ls -la /root/parts | tail -3 ;;
3)
    . bench/lease/old_env.sh
    for r in 1 2; do
        for v in old new; do
            pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
            PYTHONPATH=$pp:/tmp/site:$root timeout 120 python3 -m ddserve.bench.engine_cpu \
                --device cuda --prompt-set heldout:16 --max-tokens 128 \
                --configs ${CONFIGS:-ar,dflash-b7k4,dflash-b15k4} --sampled-configs "" \
                --no-server --name c1-r$r-$v --out $OUT 2>&1 | quiet | tail -5
            echo "c1-r$r-$v: ${SECONDS}s"
        done
    done
    timeout 150 python3 -m ddserve.bench.engine_cpu --device cuda --dtype float32 \
        --prompt-set heldout:16 --max-tokens 128 --configs ar,dflash-b15k4 --sampled-configs "" \
        --no-server --name fp32 --out $OUT 2>&1 | quiet | tail -4
    echo "fp32: ${SECONDS}s"
    timeout 120 python3 -m ddserve.bench.round_profile --device cuda --configs ar,dflash-b15k4 \
        --batches 1 --rounds 100 --kernels 30 --name rp-real --out $OUT 2>&1 | quiet
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
