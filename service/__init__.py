"""ddserve runtime: config models, engines, the OpenAI-compatible servers."""
