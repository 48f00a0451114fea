"""The one exception type of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """Input data a user supplied cannot be used; the message names the file and what to change."""
