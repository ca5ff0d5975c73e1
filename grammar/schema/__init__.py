"""The JSON-schema layer shared by every backend: ``$ref`` resolution (``refs``), JSON types
(``types``), normalisation passes (``normalise``), schema algebra (``merge``), and each
backend's keyword table as data with the walk that applies it (``xgrammar_keywords``;
``outlines_keywords`` with ``outlines_faithful``, which says whether outlines-core's converter
writes a schema as it is, and ``pattern_regex`` for its patterns)."""
