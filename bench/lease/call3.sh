mkdir -p /root/parts /root/res && cp .carry/p3/* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
DEVICE=cuda LENGTHS=30,2900,7200 REQ=32 timeout 250 bash bench/long_context.sh $R/lc after 2>&1 | grep -v transformers | tail -12
DEVICE=cuda LENGTHS= timeout 250 bash bench/long_context.sh $R/adm capped paced 2>&1 | grep -v transformers | tail -12
rm -f $R/*/*.png; tar czf $OUT/res3.tgz -C /root res
