"""Example deployments, shipped as package data (`ddserve.deploy`): `default.yaml` is the
embedded default (builtin engine, SmolLM2, CPU), `smollm2-gpu.yaml` one GPU, `kimi-tp8.yaml`
the production shape (SGLang, TP8); `prometheus.yml` scrapes a local deployment."""

from __future__ import annotations

from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = str(DEPLOY_DIR / "default.yaml")
