"""The one exception type shardkit raises for bad input; its message always names the fix."""


class ShardkitError(ValueError):
    """Bad input to shardkit. The message says what is wrong, shows the values, names the fix."""
