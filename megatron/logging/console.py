"""Third-party noise on the console: off at the default level, back with ``--verbose`` or ``--debug``.

What Deepy prints is its own: a header, a line per log interval, a summary, one copy of each error.
What the libraries underneath print on their own is hidden unless asked for:

- DeepSpeed's "Setting accelerator to CPU. If you have GPU..." warning, logged by every process that
  imports DeepSpeed on a machine without a GPU (every tool, ``--help`` included, and inside benchmark
  tables): a logging filter on DeepSpeed's logger drops it. It is installed when the ``megatron``
  package is first imported, which every entry point does before anything imports DeepSpeed.
- ``distutils`` deprecation warnings that DeepSpeed's op builders raise when they probe the compiler.
- ``print()``s that bypass DeepSpeed's logger (PipelineModule's ``SEED_LAYERS=...`` and
  ``stage=0 layers=5`` partition dump, the pipeline engine's ``steps: 10 loss: ...`` line): see
  :func:`deepspeed_prints_quiet` and :func:`megatron.deepspeed_internals.quiet_step_line`.

"Verbose" is one switch: DeepSpeed's own log level (``deepspeed_log_level``) at ``info`` or ``debug``,
which ``deepy.py --verbose`` (and ``--debug``) set. Standard library only: the launcher imports this.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

DEEPSPEED_LOGGER = "DeepSpeed"
VERBOSE_LEVELS = ("debug", "info")
NOISE = ("Setting accelerator to CPU",)
"""Starts of DeepSpeed log messages hidden at the default level."""


class _State:
    verbose: bool = False


def is_verbose(deepspeed_log_level: str) -> bool:
    """DeepSpeed's own lines (and the other libraries' noise) are shown at ``info`` and ``debug``."""
    return deepspeed_log_level in VERBOSE_LEVELS


def verbose_requested(argv: Sequence[str] | None = None) -> bool:
    """``--verbose`` or ``--debug`` on the command line, or ``DEEPY_DEBUG`` set: show everything."""
    argv = sys.argv if argv is None else argv
    return ("--verbose" in argv or "--debug" in argv
            or os.environ.get("DEEPY_DEBUG", "") not in ("", "0"))


def _drop_noise(record: logging.LogRecord) -> bool:
    if _State.verbose:
        return True
    message = record.getMessage()
    return not any(message.startswith(start) for start in NOISE)


def install_filters(verbose: bool | None = None) -> None:
    """Hide the libraries' noise in this process (idempotent); ``verbose`` None asks the command line."""
    _State.verbose = verbose_requested() if verbose is None else verbose
    logger = logging.getLogger(DEEPSPEED_LOGGER)  # DeepSpeed's LoggerFactory reuses this object
    if _drop_noise not in logger.filters:
        logger.addFilter(_drop_noise)
    if not _State.verbose:
        warnings.filterwarnings("ignore", message=r".*distutils.*")
        warnings.filterwarnings("ignore", module=r"distutils(\..*)?$")


def set_verbose(verbose: bool) -> None:
    """The rank's switch, from the resolved config's ``deepspeed_log_level``."""
    install_filters(verbose)


@contextlib.contextmanager
def deepspeed_prints_quiet() -> Iterator[None]:
    """Swallow what DeepSpeed ``print()``s past its logger inside the block (PipelineModule's seeds and
    layer partition, on rank 0) unless DeepSpeed's logger speaks at info or debug."""
    ds_logger = logging.getLogger(DEEPSPEED_LOGGER)
    if _State.verbose or ds_logger.getEffectiveLevel() <= logging.INFO:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def quiet_other_ranks(rank: int | None) -> None:
    """Progress bars on global rank 0 only: every other rank of a data-parallel job draws the same bars
    (lm-eval's, Hugging Face datasets'), so tqdm is switched off there (``TQDM_DISABLE``, which tqdm reads
    when it is imported: call this first)."""
    if rank:
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
