"""The xgrammar backend: the adapter (``backend``), the schema it is handed (``normal_form``,
with the keyword table ``keywords``) and baton's rewrites of xgrammar's EBNF (``rewrites``,
``objects``, ``patterns``)."""
