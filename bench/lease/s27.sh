# Twenty-fourth session: where a C=1 round's time goes beside the verify step (issues 14/17:
# the engine's verify read 1.55 ms where the step alone takes 1.07). One lease, calls back to
# back. `CALL=N bash bench/lease/s27.sh`:
#   0  carry .whl     the GPU tree build's tests; `round_profile --kernels` on random SmolLM2 weights (the GPU's time by
#                     phase: draft, verify, other; busy against wall; the costliest kernels)
#                     at 1 and 4 requests, AR, b7k4, b15k4; the drafter's layers fused at 1
#                     (bench/results/round-profile/draft-fused.json); the GPU tree build
#                     before (tree_triton_before.py) vs now (`bench.tree_build`); s26's verify steps of 16 rows
#                     with qkv on GEMV in 8-row blocks against the default
mkdir -p /root/parts
cp .carry/q*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
case ${CALL:?} in
0)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tree_triton.py 2>&1 |
        tail -4 | tee $OUT/gpu_tests_tree.txt
    timeout 300 python3 -m ddserve.bench.round_profile --model random-smollm2 --device cuda \
        --configs ${CONFIGS:-ar,dflash-b7k4,dflash-b15k4} --batches ${BATCHES:-1,4} \
        --rounds 100 --kernels 30 --name rp-random --out $OUT 2>&1 |
        grep -v -e Warning -e warn
    echo "round_profile: ${SECONDS}s"
    timeout 200 python3 -m ddserve.bench.tuned bench/results/round-profile/draft-fused.json \
        ddserve.bench.round_profile --model random-smollm2 --device cuda \
        --configs dflash-b7k4,dflash-b15k4 --batches 1 --rounds 100 --kernels 30 \
        --name rp-random-draft-fused --out $OUT 2>&1 | grep -v -e Warning -e warn
    echo "round_profile, the drafter fused: ${SECONDS}s"
    timeout 100 python3 -m ddserve.bench.tree_build \
        --against bench/results/round-profile/tree_triton_before.py --out $OUT 2>&1 | tail -8
    [ -n "${SKIP_STEPS:-}" ] || timeout 150 python3 -m ddserve.bench.static_step \
        --model random-smollm2 --attention triton --modes fused,fused+tuned \
        --fused-tune bench/results/verify-attention/last/lk-16-gemv8.json \
        --batches 1,4,16 --widths 16 --context 256 --name steps-gemv16 --out $OUT 2>&1 |
        grep -v Warning | tail -8
    ;;
esac
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
