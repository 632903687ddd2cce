#!/usr/bin/env bash
# Install, start the builtin engine on the embedded default (SmolLM2-135M-Instruct, CPU,
# its bundled DFlash block drafter, DDTree budget 3 / topk 1: the fastest measured on a
# 2-core CPU) on 127.0.0.1:30000, and ask it one question.
# The server keeps running afterwards; stop it with: kill $(cat /tmp/ddserve-engine.pid)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PORT=${PORT:-30000}
export HF_HUB_OFFLINE=1
bash deploy/install.sh
if [ -f /tmp/ddserve-engine.pid ] && kill -0 "$(cat /tmp/ddserve-engine.pid)" 2>/dev/null; then
  kill "$(cat /tmp/ddserve-engine.pid)"; sleep 1
fi
nohup "$PY" -m ddserve engine --port "$PORT" --drafter dflash --budget 3 --topk 1 >/tmp/ddserve-engine.log 2>&1 &
echo $! >/tmp/ddserve-engine.pid
echo "starting the engine (first start converts the bundled GGUF once, ~30 s; log: /tmp/ddserve-engine.log)"
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$(cat /tmp/ddserve-engine.pid)" 2>/dev/null || { tail -20 /tmp/ddserve-engine.log; exit 1; }
  sleep 1
done
"$PY" -m ddserve chat "What is the capital of France? Answer in one sentence." --url "http://127.0.0.1:$PORT"
cat <<MSG

The engine is still serving on http://127.0.0.1:$PORT (OpenAI API under /v1). Try:
  curl -s http://127.0.0.1:$PORT/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a haiku about trees"}], "max_tokens": 48}'
Stop it with: kill \$(cat /tmp/ddserve-engine.pid)
MSG
