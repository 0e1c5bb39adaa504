"""``ft serve``: an OpenAI-compatible HTTP server on the fast engine.

``protocol`` (the wire format and its validation), ``engine_loop`` (the engine on its own thread),
``detokenize`` (streamed text), ``sse`` (event streams), ``metrics`` (Prometheus), ``app`` (the
FastAPI routes), ``server`` (the command: startup, summary, drain on SIGTERM).
"""
