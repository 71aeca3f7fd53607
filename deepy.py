#!/usr/bin/env python
"""Launch a Deepy run: ``python deepy.py [--dry-run] train.py CONFIG... [key=value ...]``.

Thin on purpose: the command line lives in ``megatron/app/deepy.py``; user mistakes come
out as one message with exit code 2 (``--debug`` shows the traceback).
"""

import os
import sys

# run from any directory: the package sits next to this file
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.errors import run_guarded  # noqa: E402
from megatron.app.deepy import main  # noqa: E402

if __name__ == "__main__":
    run_guarded(main)
