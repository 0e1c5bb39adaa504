"""The engine's tensor-parallel ranks (``workers.py``)."""
