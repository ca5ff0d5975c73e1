"""The one error every model loader raises for input it cannot use."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path, file or tensor that cannot be loaded.

    The message names the path (and, where it applies, the tensor, type or key)
    and says what was expected, so that the caller can fix the input without
    reading a traceback from numpy, struct or safetensors.
    """
