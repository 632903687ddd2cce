"""HTTP servers: the engine server (native generate, OpenAI API, health, admin)."""
