"""The one exception type shardkit raises for bad input; its message always names the fix."""


class ShardkitError(ValueError):
    """Bad input to shardkit. The message says what is wrong, shows the values, names the fix."""


def short_repr(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never prints a whole model.

    Example:
      >>> short_repr(list(range(100)), limit=20)
      '[0, 1, 2, 3, 4, 5, 6… (a list)'
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… (a {type(value).__name__})"
