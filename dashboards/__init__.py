"""Grafana dashboards, generated from code (grafana-foundation-sdk); the JSON is committed."""
