"""``reinit_tokens`` as a feature: the named tokens' rows re-drawn when the run starts at step 0, after the starting
weights are loaded (Levanter's ``sft.py``; a resumed run keeps the rows it trained). Before the EMA in ``FEATURES``:
the average starts at the re-drawn rows."""

from __future__ import annotations

from megatron.engine.build import Engine
from megatron.engine.process import speaks
from megatron.logging.log import get_logger
from megatron.training.features.base import Setup
from megatron.training.loop import LoopHooks, TrainState
from megatron.training.train_config import TrainConfig
from megatron.training.reinit_tokens import reinit_tokens


def build_reinit_tokens(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None without ``reinit_tokens``."""
    keys = run.reinit
    if not keys.reinit_tokens:
        return None

    def resume(eng: Engine, state: TrainState) -> None:
        redrawn = reinit_tokens(eng.engine.module, keys, setup.tokenizer, iteration=state.iteration,
                                tied=not eng.config.no_weight_tying, seed=run.training.seed,
                                optimizer=eng.engine.optimizer, partitioned=setup.zero_stage == 3)
        if redrawn and speaks():
            get_logger().info("reinit_tokens: re-drew the rows of %s in %s", ", ".join(keys.reinit_tokens or []),
                              " and ".join(redrawn))

    return LoopHooks(name="reinit_tokens", resume=resume)
