"""User-facing errors shared by both sides.

A ``UserInputError`` is a problem with what the user gave us (a path, a config, a tensor, a
sampling parameter). The CLI prints its message on one line and exits non-zero without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input from the user: the message names the field, the value and what was expected."""


class ConfigError(UserInputError):
    """A config.json (target or draft) that this code cannot serve."""


class CheckpointError(UserInputError):
    """A checkpoint whose files or tensors are missing, misnamed or misshaped."""


class RequestError(UserInputError):
    """A generation request with an invalid parameter (prompt, sampling, length)."""


def is_int(value) -> bool:
    """An int that is not a bool (JSON ``true`` parses as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(fields: dict, field: str, default=None, prefix: str = "",
                 error: type[UserInputError] = ConfigError) -> int:
    """``fields[field]`` (or ``default``) as a positive integer; ``prefix`` names the enclosing block."""
    value = fields.get(field, default)
    expect(is_int(value) and value > 0, error, prefix + field, value, "a positive integer")
    return value


def expect(condition: bool, error: type[UserInputError], field: str, value, expected: str) -> None:
    """Raise ``error`` saying ``field`` was ``value`` where ``expected`` was wanted."""
    if not condition:
        raise error(f"{field}={value!r}: expected {expected}")
