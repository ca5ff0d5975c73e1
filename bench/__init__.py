"""baton.bench: the benchmarks, one folder per family (``baton bench NAME`` finds a benchmark's
folder in :data:`baton.bench.cli.BENCHMARKS`), and what they share at the top.

No folder is named like an installed top-level package (``kernels``, ``llama_cpp``): a command
run from inside bench/ has it first on ``sys.path``, where such a folder would hide the package.
"""
