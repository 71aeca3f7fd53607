"""Deepy's trainer package.

Importing it hides the noise DeepSpeed makes on import on machines without a GPU (its "Setting
accelerator to CPU" warning) unless ``--verbose``/``--debug`` is on the command line: every entry point
imports ``megatron`` before anything imports DeepSpeed (``megatron/logging/console.py``).
"""

from megatron.logging.console import install_filters as _install_filters

_install_filters()
