#!/usr/bin/env bash
# Install everything and run lint + the whole test suite (fast and slow tiers; the gpu tier
# skips itself without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1
bash deploy/install.sh
"$PY" -m ruff check .
"$PY" -m pytest -q -p no:cacheprovider "$@"
