"""``hf_save_path`` as a feature: the model as Hugging Face directories at Levanter's hook steps
(``hf_saves.HFSaves``), after the step's checkpoint, from the EMA's weights when there is one; rank 0 writes."""

from __future__ import annotations

from megatron import mpu
from megatron.errors import ConfigError
from megatron.training.features.base import Setup, step_saves_hooks
from megatron.training.hf_saves import HFSaves, save_dtype
from megatron.training.loop import LoopHooks
from megatron.training.train_config import TrainConfig


def build_hf_saves(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None without ``hf_save_path``. The writer is built now: it refuses a model or tokenizer it cannot write
    before the first step."""
    keys = run.hf_saves
    if keys.hf_save_path is None:
        return None
    if setup.hf_writer is None:
        raise ConfigError("hf_save_path: this program was not given the HF writer (train.py gives it)")
    writer = setup.hf_writer(setup.eng.config, run.tokenizer, save_dtype(keys, run.training.precision),
                             run.lora.lora_scale if run.lora.lora_enabled else None) if setup.rank == 0 else None
    saves = HFSaves(keys, setup.saved_weights(list(setup.eng.engine.module.parameters())), writer,
                    agree=mpu.rank0_decides, ema_beta=run.averaging.ema_beta)
    return step_saves_hooks("hf_save_path", saves, setup.train_iters)
