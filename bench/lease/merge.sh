mkdir -p /root/parts /root/res && cp .carry/p1/* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_attention.py tests/engine/test_static_engine.py::test_graphs_equal_reference_cuda_fp32 > $R/gpu_tests_2.txt 2>&1; tail -2 $R/gpu_tests_2.txt
timeout 200 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1,16 --widths 2 --context 30,2900,7200 --attention triton --modes compile --prefill 1000,2900 --name static_step_merge --out $R 2>&1 | grep -v Warn | tail -12
timeout 90 python3 -m ddserve.bench.prefill_attention --cases 0:1024,2048:1024,5120:1024,2048:2048 --name prefill_attention_merge --out $R 2>&1 | grep -v Warn | tail -4
tar czf $OUT/res.tgz -C /root res
