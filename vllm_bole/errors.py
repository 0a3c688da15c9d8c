"""Bole's errors, importable by every layer."""


class BoleConfigError(ValueError):
    """A bad value in ``speculative_config``; the message names the field and what is allowed."""
