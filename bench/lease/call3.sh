mkdir -p /root/parts /root/res && cp .carry/p3/* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
DEVICE=cuda LENGTHS=30,2900,7200 REQ=32 timeout 330 bash bench/long_context.sh $R/lc after 2>&1 | grep -v transformers | tail -12
DEVICE=cuda LENGTHS= timeout 200 bash bench/long_context.sh $R/adm paced 2>&1 | grep -v transformers | tail -8
rm -f $R/*/*.png; tar czf $OUT/res3.tgz -C /root res
