"""The offline engine (``LLM``) end to end: async vs sync, forward pass and throughput
against transformers, structured vs free, speculative decoding, batch invariance, tensor and
data parallel, and the peers (the same JSON workload on other engines)."""
