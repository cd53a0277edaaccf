"""Client edge: the OpenAI-compatible API, chat templates, the decode loop and SSE telemetry."""
