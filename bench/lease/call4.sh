mkdir -p /root/parts /root/res && cp .carry/p4/* /root/parts/ && . bench/device_env.sh /root/parts
R=/root/res
LEVELS=${LEVELS:-1,16,64} REQ=256 BUDGETS=0 PROMPTS=chat MAXB=64 timeout 400 bash bench/serving_path.sh $R/path inproc http 2>&1 | grep -v transformers | tail -12
rm -f $R/*/*.png; tar czf $OUT/res4.tgz -C /root res
