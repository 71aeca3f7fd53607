"""Errors a user can cause, and the one place they are turned into a clean exit.

Every mistake a user can make (config, data, checkpoint, CLI) raises a subclass of
:class:`DeepyError`. Entry points wrap their ``main`` with :func:`run_guarded`, which prints
the message on one line block, exits with code 2 and hides the traceback unless ``--debug``
is on the command line (or ``DEEPY_DEBUG=1`` is set).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

USER_ERROR_EXIT_CODE = 2


class DeepyError(Exception):
    """A mistake in user input: printed without a traceback, exit code 2."""

    kind: str = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(DeepyError):
    """A wrong config key, type, value or combination."""

    kind = "config error"


class DataError(DeepyError):
    """Bad input data: malformed jsonl, corrupt .bin/.idx, empty corpus."""

    kind = "data error"


class CheckpointError(DeepyError):
    """A missing, incomplete or incompatible checkpoint."""

    kind = "checkpoint error"


class ConversionError(DeepyError):
    """A model that cannot be converted faithfully to or from another format (HF, GPT-NeoX)."""

    kind = "conversion error"


class UsageError(DeepyError):
    """A bad command line."""

    kind = "usage error"


def required(value: _T | None, key: str, why: str) -> _T:
    """``value`` when the config set it; a :class:`ConfigError` naming ``key`` and ``why`` it is needed."""
    if value is None:
        raise ConfigError(f"{key} must be set: {why}")
    return value


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv if argv is None else argv
    return "--debug" in argv or os.environ.get("DEEPY_DEBUG", "") not in ("", "0")


ErrorReport = Callable[[str, str], bool]
"""``report(message, traceback) -> print here?``: a rank records its error for deepy.py, which prints
each error of a run once (``megatron/logging/rank_errors.py``); False when another rank prints it."""


def run_guarded(main: Callable[[], int | None], argv: list[str] | None = None,
                report: ErrorReport | None = None) -> None:
    """Run ``main``; turn a DeepyError into one message on stderr and exit code 2.

    With ``report`` (a worker rank), every other exception is reported too (exit code 1), and the
    message (and traceback) is printed only where ``report`` says so."""
    try:
        code = main()
    except DeepyError as err:
        message = f"deepy: {err.kind}: {err.message}"
        details = traceback.format_exc() if debug_requested(argv) else ""
        if report is None or report(message, details):
            print(details + message, file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    except KeyboardInterrupt:
        print("deepy: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        if report is None:
            raise
        details = traceback.format_exc()
        if report(f"{type(err).__name__}: {err}".splitlines()[0], details):
            print(details, end="", file=sys.stderr)
        sys.exit(1)
    sys.exit(code or 0)
