"""Grammar compiles off the engine's thread: ``service`` (backend choice, cache, queue),
``dispatcher`` (runs the queue on workers, time limits), ``pool`` (the engine's handles on
worker processes) and ``worker`` (the worker processes themselves)."""
