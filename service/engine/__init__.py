"""The builtin DDTree engine: pure PyTorch (no Ray, FastAPI or prometheus imports)."""
