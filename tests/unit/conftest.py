"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """This process as a world of one gloo rank, its model-parallel groups made (tp 1, no pipeline), for a module's
    tests that build a real DeepSpeed engine."""
    from single_rank import init_single_rank_gloo

    from megatron import mpu

    init_single_rank_gloo()
    mpu.initialize_model_parallel(1, 0)
    yield
    mpu.destroy_model_parallel()
