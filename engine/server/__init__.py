"""The OpenAI-compatible HTTP server: ``build_app(AsyncLLM, ServerConfig)`` and ``baton serve``.

Modules: ``protocol`` (request bodies), ``params`` (bodies -> SamplingParams), ``chat`` and
``completions`` (the two generation endpoints), ``generation`` (streams, disconnects, SSE),
``logprobs``, ``errors`` (OpenAI error objects), ``middleware`` (API key, body limit),
``metrics`` (Prometheus text), ``app`` (the app factory), ``serve`` (the CLI entry).
"""
