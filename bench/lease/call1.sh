mkdir -p /root/parts /root/res && cp .carry/p1/* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_attention.py tests/engine/test_static_engine.py::test_graphs_equal_reference_cuda_fp32 tests/engine/test_static_engine.py::test_prompt_chunks_after_warm_up_equal_reference_fp32 > $R/gpu_tests_1.txt 2>&1; tail -3 $R/gpu_tests_1.txt
timeout 220 python3 -m ddserve.bench.static_step --model random-smollm2 --batches 1 --widths 2 --context 30,1000,2900,7200 --attention triton --modes compile --prefill 1000,2900,7200 --name static_step --out $R 2>&1 | grep -v Warn | tail -16
timeout 120 python3 -m ddserve.bench.prefill_attention --cases 0:2048,2048:2048,5120:2048,0:7200 --out $R 2>&1 | grep -v Warn | tail -5
tar czf $OUT/res1.tgz -C /root res
