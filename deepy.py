#!/usr/bin/env python
"""Launch a Deepy run: ``python deepy.py [--dry-run] train.py CONFIG... [key=value ...]``.

Thin on purpose: the command line lives in ``megatron/app/deepy.py``; user mistakes come
out as one message with exit code 2 (``--debug`` shows the traceback).
"""

# Python puts this file's folder first on sys.path, so the megatron package beside it is the one
# imported, from any working directory.
from megatron.errors import run_guarded
from megatron.app.deepy import main

if __name__ == "__main__":
    run_guarded(main)
