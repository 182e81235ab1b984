"""The data pipeline's error type (defined with the others in :mod:`paratron.errors`)."""

from paratron.errors import DataError

__all__ = ["DataError"]
