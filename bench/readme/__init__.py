"""The results pages: docs/results.md's and the README's tables rendered from the JSON files
in bench/results/, and docs/models.md's table of supported models."""
