"""How users reach the engine: ``LLM`` (offline batches), ``AsyncLLM`` (asyncio streaming),
the ``baton`` command, and the one parser of engine arguments they share."""
