"""How many GPUs this machine offers, asked without importing torch where the answer is plainly none.

deepy.py needs the count to size a local launch and to pick the accelerator its checks assume.
Importing torch to ask costs about 2 s of a CPU's time on every launch; a machine without an NVIDIA
or AMD driver cannot have a CUDA or ROCm device, so there the answer is 0 without torch. Where a
driver exists, torch answers, honouring ``CUDA_VISIBLE_DEVICES`` as the ranks will.
"""

from __future__ import annotations

import os

GPU_DRIVER_PATHS: tuple[str, ...] = (
    "/proc/driver/nvidia",  # NVIDIA's kernel driver
    "/dev/nvidiactl",
    "/dev/kfd",  # AMD ROCm
    "/dev/dxg",  # GPUs passed into WSL2
)


def gpu_driver_present() -> bool:
    """True when a GPU driver is installed here (torch may then see devices)."""
    return any(os.path.exists(path) for path in GPU_DRIVER_PATHS)


def gpu_count() -> int:
    """CUDA/ROCm devices torch sees on this machine; 0 without a GPU driver (torch not imported)."""
    if not gpu_driver_present():
        return 0
    # lazy: torch only where a GPU driver is; the launcher counts GPUs without it
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
