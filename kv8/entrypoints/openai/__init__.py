"""The OpenAI-compatible HTTP server of one engine: the app and its routes, request models, serving logic, tool
calling, the tokenizer routes and metrics (``kv8 serve``)."""
