"""The outlines-core backend: the adapter (``backend``), whether its JSON-schema converter
writes a schema as it is (``faithful``) and its keyword table (``keywords``)."""
