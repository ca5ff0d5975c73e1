"""The ``baton`` command line (``main.py``): the top floor, above the server and the Python
entry points it starts."""
