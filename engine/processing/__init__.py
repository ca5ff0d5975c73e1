"""The text layer around the core: ``LLMEngine`` (input checks and tokenisation, n > 1 fan-out,
composition of core + executor), detokenisation and stop strings, ``RequestOutput``s."""
