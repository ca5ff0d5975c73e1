"""How the engine's steps reach the device: the ``Executor`` interface the core talks to
(``base``), the in-process executor (``uni``) and the worker-process executor (``multiproc``)."""
