"""Grafana dashboards, generated from code (grafanalib); the JSON is committed."""
