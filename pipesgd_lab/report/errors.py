"""The one error type of the reports."""


class ReportError(ValueError):
    """A report cannot be built; the message names the path and what was expected there."""
