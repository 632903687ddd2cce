# Twenty-fifth session: split-K for the fused layer's projections at 16 rows (issue 17: a
# 16-row verify step spends ~26 us a layer in tensor-core tiles of 15-48 programs), and what
# s27.sh had for the twenty-fourth session's work (compiled glue, the GPU tree build).
# `CALL=N bash bench/lease/s28.sh`, calls back to back on one machine (`CALL=quick`, carry
# .whl: call 0's most telling part, verify steps against unsplit.json (split-K, 3 at 16
# rows, is the default since the lease) then the GPU tests, then split2, for a short lease; FOLD_MERGE, which s28 also compared, is gone since):
#   0  carry .whl   GPU tests of the split kernels (bf16 and fp32 against the reference,
#                   the PDL chain's bits against serial launches, the engine's fp32 greedy on
#                   split sets), the tree build and compiled glue; verify steps (random
#                   SmolLM2, triton attention, 256 keys, B 1/4 x W 1/8/16) the defaults against
#                   each JSON of bench/results/layer-split/ (split-K), side by side per run;
#                   each 16-row kernel alone unsplit / split 2 / 3 (bench.layer_kernels)
#   1  carry .whl .carry/old   the GPU tree build before/now; a C=1 round by phase
#                   (round_profile, random SmolLM2, ar and b15k4): the session start of
#                   the twenty-fourth (.carry/old) against this tree, and this tree with
#                   ${SPLIT_JSON:-unsplit}.json (split-K is the default since the lease)
. bench/device_env.sh /root/parts
L=bench/results/layer-split
case ${CALL:?} in
tiny)  # carry .whl: one verify-step comparison, split3 (the default since) vs unsplit (~1.5 min)
    timeout 100 python3 -m ddserve.bench.static_step --model random-smollm2 \
        --modes fused,fused+tuned --fused-tune $L/unsplit.json --attention triton \
        --batches 1 --widths 1,16 --context 256 --name steps-unsplit --out $OUT 2>&1 |
        grep -e "^fused" -e Error -e error | cut -c1-110
    ;;
quick)  # carry .whl: the most telling first, for a short lease (~5 min)
    for j in unsplit split2; do
        timeout 90 python3 -m ddserve.bench.static_step --model random-smollm2 \
            --modes fused,fused+tuned --fused-tune $L/$j.json --attention triton \
            --batches 1 --widths 1,16 --context 256 --name steps-$j --out $OUT 2>&1 |
            grep -e "^fused" -e Error -e error | cut -c1-110
        echo "$j: ${SECONDS}s"
        [ $j = unsplit ] && timeout 180 python3 -m pytest -q -p no:cacheprovider \
            tests/engine/test_layer_triton.py tests/engine/test_attention.py \
            -k "split" 2>&1 | tail -4 | tee $OUT/gpu_tests_split.txt
    done
    ;;
0)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_attention.py -k "split" 2>&1 | tail -4 |
        tee $OUT/gpu_tests_split.txt
    echo "split tests: ${SECONDS}s"
    for j in ${JSONS:-unsplit split2 split3-qkv-down}; do
        timeout 120 python3 -m ddserve.bench.static_step --model random-smollm2 \
            --modes fused,fused+tuned --fused-tune $L/$j.json --attention triton \
            --batches 1,4 --widths 1,8,16 --context 256 --name steps-$j --out $OUT 2>&1 |
            grep -e "^fused" -e Error -e error | cut -c1-110
        echo "$j: ${SECONDS}s"
    done
    # each kernel alone at 16 rows, its default set unsplit / split 2 / 3 (then the layer)
    timeout 100 python3 -m ddserve.bench.layer_kernels --rows 16 --grids defaults \
        --kernels qkv,gate_up,o,down --splits 1,2,3 --verbose --name lk-split --out $OUT 2>&1 |
        grep -e "^rows" | cut -c1-160
    echo "layer_kernels: ${SECONDS}s"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py \
        tests/engine/test_static_engine.py -k "tree or compiled_glue" 2>&1 |
        tail -4 | tee $OUT/gpu_tests_tree_glue.txt
    ;;
1)
    . bench/lease/old_env.sh
    timeout 60 python3 -m ddserve.bench.tree_build \
        --against .carry/old/service/engine/tree_triton.py --out $OUT 2>&1 | tail -8
    for v in new old alt; do
        pp=/tmp/pp; [ $v = old ] && pp=/tmp/pp-old
        pre=(-m ddserve.bench.round_profile)
        [ $v = alt ] && pre=(-m ddserve.bench.tuned $L/${SPLIT_JSON:-unsplit}.json ddserve.bench.round_profile)
        PYTHONPATH=$pp:/tmp/site:$root timeout 120 python3 "${pre[@]}" \
            --model random-smollm2 --device cuda --configs dflash-b15k4,ar --batches 1 \
            --rounds 100 --kernels 20 --name rp-$v --out $OUT 2>&1 | grep -v -e Warning -e warn
        echo "rp-$v: ${SECONDS}s"
    done
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
