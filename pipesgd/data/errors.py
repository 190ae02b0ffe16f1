"""The one exception the data package raises for data problems (not for bad constructor arguments).

Its message is one line that names the file or directory involved and says what was expected or
allowed, so a user can fix the problem from the log alone. Bad argument values raise ValueError.
"""

from __future__ import annotations


class DatasetError(RuntimeError):
    """A dataset is missing, corrupt, unverifiable, or unsafe to load."""
