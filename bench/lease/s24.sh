# Issue 17's next lease (written after s23.sh, not run yet): the GEMV sets where s23 left
# them unmeasured, one call, random weights (no GGUF). `bash bench/lease/s24.sh`, carrying
# .whl (bench/device_pack.sh):
#   GPU tests of the fused layers: the 1-row PDL chain on the default GEMV sets (added after
#   s23's lease), the 2- and 4-row layer cases; then `layer_kernels --grids gemv` at 8 rows
#   (the defaults give 8 rows the 16-row tensor-core sets, unmeasured against GEMV) and at 1
#   row with the tensor-core grid beside (attention's splits too); verify steps at B=1 x
#   W=1/2/4/8/16 and B=8 x W=1: compile / fused / fused+tuned (the 8-row sweep)
. bench/device_env.sh /root/parts
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_layer_triton.py 2>&1 |
    tail -8 | tee $OUT/gpu_tests.txt
timeout 120 python3 -m ddserve.bench.layer_kernels --rows 8 --grids gemv \
    --kernels qkv,gate_up,o,down --name lk-gemv8 --out $OUT 2>&1 | grep -v Warning | tail -6
timeout 150 python3 -m ddserve.bench.layer_kernels --rows 1 --grids tc,gemv --name lk-1-all \
    --out $OUT 2>&1 | grep -v Warning | tail -7
timeout 150 python3 -m ddserve.bench.static_step --model random-smollm2 --attention triton \
    --modes compile,fused,fused+tuned --fused-tune $OUT/lk-gemv8.json --batches 1,8 \
    --widths 1,2,4,8,16 --context 256 --name steps-gemv8 --out $OUT 2>&1 | grep -v Warning | tail -30
rm -f $OUT/*.png
echo "done at ${SECONDS}s"
