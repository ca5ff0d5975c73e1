"""The grammar backends on their own: compile and mask times (``baton bench grammar``,
``masks``), the grammar layer's overhead, open objects, and a burst of schemas at once."""
