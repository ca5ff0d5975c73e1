"""baton against llama.cpp: ``baton bench serve_peers`` (baton serve vs llama-server), the
llama.cpp build it needs, and random-weight GGUF files of real model shapes."""
