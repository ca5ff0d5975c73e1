"""The llguidance backend (``backend``)."""
