mkdir -p /root/parts /root/res && cp .carry/p5/* /root/parts/ && . bench/device_env.sh /root/parts && . bench/device_ray.sh
R=/root/res; ray --version
LEVELS=1,16,64 REQ=256 BUDGETS=0 PROMPTS=chat MAXB=64 timeout 330 bash bench/serving_path.sh $R/path ray-haproxy 2>&1 | grep -v transformers | tail -8
L=/tmp/ray/session_latest/logs; grep -v '^/\|^ *$' $L/raylet.err $L/dashboard_agent.log 2>/dev/null | tail -4 | cut -c1-300
python3 -m ddserve.bench.serving_path_report $R/path 2>&1 | grep -v Warn | tail -9
rm -f $R/*/*.png; tar czf $OUT/res5.tgz -C /root res
