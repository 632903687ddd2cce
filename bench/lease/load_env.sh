# Sourced by the lease scripts (s36 on) on the device machine: the GGUF's carried parts
# joined under /root/parts and the environment set (bench/device_env.sh), a filter for the
# load benchmarks' noise (`quiet`) and their table's rows (`table`), and the engine_load
# arguments every such lease compares under (`LOAD`, results into $OUT).
mkdir -p /root/parts
cp .carry/r*/* /root/parts/ 2>/dev/null
. bench/device_env.sh /root/parts
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
table() { grep -e "^config" -e "^[ad][a-z0-9@-]* *[0-9]" -e Error | cut -c1-140; }
LOAD="--device cuda --requests 32 --waves 16 --max-tokens 128 --prompt-set heldout:16 --first-token-share 0.5 --out $OUT"
