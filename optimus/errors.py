"""The error a user's configuration raises, and its commonest check: at the bottom of the import graph, so that
every layer can raise it."""


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message says what to change."""


def check_choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    """Refuse `key`=`value` unless it is one of `allowed`, naming them."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported: set it to one of {', '.join(allowed)}.")
