# Twelfth session, issue 13: a Ray replica's API processes (`api_server_count`) on the H200.
# Five calls back to back; the first three are bench/lease/pdl_next.sh's (issue 17/14), which
# also bring the GGUF, and Ray's wheel rides along in three pieces (bench/device_pack.sh):
#   1: CALL=1 bash bench/lease/pdl_next.sh     carry .whl .carry/q1
#   2: CALL=2 bash bench/lease/pdl_next.sh     carry .carry/q2
#   3: bash bench/lease/pdl_next.sh            carry .carry/q3 .carry/r1
#   4: CALL=4 bash bench/lease/ray_asc.sh      carry .carry/r2: the API process's part of a
#      long prompt's first token on this host, and a ~7,200-token prompt's TTFT (issue 18)
#   5: bash bench/lease/ray_asc.sh             carry .carry/r3 (the rest of Ray and the
#      Serve extras): the serving path, AR, C=1/16/64, 256 requests a level: the in-process
#      runner, `ddserve up` with the HAProxy ingress and 1 API process, and with 4
mkdir -p /root/parts /root/res
cp .carry/r?/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
quiet() { grep -v -E 'Warn|transformers|^ *$'; }
if [ "${CALL:-5}" = 4 ]; then
    nproc
    timeout 120 python3 -m ddserve.bench.api_overhead --lengths 30,2900,7200 --requests 30 \
        --out $R 2>&1 | quiet | tail -4
    tar czf $OUT/res4.tgz -C /root res
    DEVICE=cuda LENGTHS=7200 LEVELS=1 REQ=32 timeout 300 bash bench/long_context.sh $R/lc paced \
        2>&1 | quiet | tail -8
    tar czf $OUT/res4.tgz -C /root res
else
    . bench/device_ray.sh
    ray --version
    LEVELS=1,16,64 REQ=256 BUDGETS=0 PROMPTS=chat MAXB=64 timeout 560 bash bench/serving_path.sh \
        $R/path inproc ray-asc ray-haproxy 2>&1 | quiet | tail -14
    python3 -m ddserve.bench.serving_path_report $R/path 2>&1 | quiet | tail -9
    rm -f $R/*/*.png
    tar czf $OUT/res5.tgz -C /root res
fi
