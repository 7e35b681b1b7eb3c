"""The one error a model source raises when it cannot be loaded (shared by every format reader)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model source is missing, incomplete or not a supported architecture."""
