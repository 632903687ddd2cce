# Issue 17's next lease (written in the twenty-third session, not run yet): one call,
# random weights, carrying .whl (bench/device_pack.sh). `bash bench/lease/s26.sh`:
#   GPU tests of the attention and the fused layers (the 65-row cases left out);
#   the drafter's block attention (FULL mode: the tree rule since s25's last call) before /
#   now at more shapes; verify steps of 16 rows with qkv on GEMV in 8-row blocks (no overlap)
#   against the tensor-core default (overlapped at 1-4 slots);
#   the layer kernels at 8 and 16 rows on the tensor-core and GEMV grids (what a verify of
#   one request's 8-16 tree rows spends outside attention: ~26 us a layer at 16 rows), and
#   at 16 rows the GEMV grid in row blocks of 8 (layer_launch.GEMV_BLOCK_ROWS)
. bench/device_env.sh /root/parts
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py \
    tests/engine/test_layer_triton.py -k "not 65" 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
echo "tests: ${SECONDS}s"
timeout 150 python3 -m ddserve.bench.verify_attention --mode full \
    --shapes 1x8,1x16,4x8,16x8 --keys 256,2048 --name va-full --out $OUT 2>&1 |
    grep -v Warning | tail -10
echo "verify_attention: ${SECONDS}s"
timeout 150 python3 -m ddserve.bench.static_step --model random-smollm2 --attention triton \
    --modes fused,fused+tuned --fused-tune bench/results/verify-attention/last/lk-16-gemv8.json \
    --batches 1,4,16 --widths 16 --context 256 --name steps-gemv16 --out $OUT 2>&1 |
    grep -v Warning | tail -8
timeout 180 python3 -m ddserve.bench.layer_kernels --rows 8,16 --grids tc,gemv \
    --kernels qkv,gate_up,o,down --name lk-8-16 --out $OUT 2>&1 | grep -v Warning | tail -6
timeout 120 python3 -m ddserve.bench.layer_kernels --rows 16 --grids gemv --gemv-block-rows 8 \
    --kernels qkv,gate_up,o,down --name lk-16-gemv8 --out $OUT 2>&1 | grep -v Warning | tail -6
rm -f $OUT/*.png 2>/dev/null || true
echo "done at ${SECONDS}s"
