"""The JSON-schema layer shared by every backend: ``$ref`` resolution (``refs``), JSON types
(``types``), normalisation passes (``normalise``), and each backend's keyword table as data
with the walk that finds the keywords it would not enforce (``xgrammar_keywords``,
``outlines_keywords``; outlines' schema rewriting in ``outlines_prepare``, its pattern
translation in ``pattern_regex``)."""
