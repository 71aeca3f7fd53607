"""Host-to-device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory to a GPU is staged by the driver after the stream's
earlier work: the host waits for every kernel already queued, once per copy. A copy from page-locked
(pinned) memory with ``non_blocking=True`` is queued like a kernel and the host runs on. Pinning
where the batch is finally shaped (the objective's micro-batch, not the raw sample: slicing and
masking make new, unpinned tensors) is what keeps the host ahead.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: pinned and copied asynchronously to a GPU, an ordinary copy elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
