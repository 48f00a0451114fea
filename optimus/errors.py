"""The error a user's configuration raises: at the bottom of the import graph, so that every layer can raise it."""


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message says what to change."""
