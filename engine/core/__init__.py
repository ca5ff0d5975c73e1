"""The step loop and what it owns: requests, the scheduler (sync and async), KV blocks,
the structured-output manager and step statistics. Token ids only: no text, no device."""
