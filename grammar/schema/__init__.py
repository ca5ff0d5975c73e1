"""The JSON-schema layer shared by every backend: ``$ref`` resolution (``refs``), JSON types
(``types``), normalisation passes (``normalise``), schema algebra (``merge``), the oneOf
disjointness proof (``disjoint``) and JSON-schema ``pattern`` helpers (``pattern_regex``).
Each backend's own keyword table and schema rewrites live in its folder (``xgrammar/``,
``outlines/``)."""
