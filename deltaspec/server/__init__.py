"""OpenAI-compatible HTTP server: request/response shaping around the engine."""
