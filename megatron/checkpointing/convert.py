"""``python -m megatron.checkpointing.convert``: DeepSpeed's ``ds_to_universal`` run safely.

Every ``torch.load`` inside the converter is weights-only (see ``safe_load.py``): converting a
checkpoint for a new layout must not run code from it any more than loading it does. The
converter is started with one worker per stage; its children inherit torch's weights-only switch.
"""

from __future__ import annotations

import contextlib
import runpy
import sys

from megatron.checkpointing.safe_load import weights_only_loading
from megatron.errors import CheckpointError


def main() -> None:
    # the refused file is named from the checkpoint being converted
    source = sys.argv[sys.argv.index("--input_folder") + 1] if "--input_folder" in sys.argv else None
    # without --input_folder ds_to_universal's own argument parser names the missing argument (exit 2)
    guard = contextlib.nullcontext() if source is None else weights_only_loading(source)
    try:
        with guard:
            runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
    except CheckpointError as err:
        print(f"deepy: checkpoint error: {err.message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
