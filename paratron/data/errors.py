"""The one error type of the data pipeline."""


class DataError(ValueError):
    """A data problem a user can fix: a missing, truncated or foreign file, a bad flag value,
    an empty split. Its message is one line naming the file (or setting) and the problem."""
