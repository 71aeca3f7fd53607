"""``python -m megatron.checkpointing.convert``: DeepSpeed's ``ds_to_universal`` run safely.

Every ``torch.load`` inside the converter is weights-only (see ``safe_load.py``): converting a
checkpoint for a new layout must not run code from it any more than loading it does. The
converter is started with one worker per stage, so no child process escapes the patch.
"""

from __future__ import annotations

import runpy

from megatron.checkpointing.safe_load import weights_only_loading


def main() -> None:
    with weights_only_loading():
        runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
