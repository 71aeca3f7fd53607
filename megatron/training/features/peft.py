"""``lora_peft_save_path`` as a feature: the LoRA adapters as PEFT directories at Levanter's hook steps
(``peft_saves.PeftSaves``), after the step's checkpoint, from the EMA's weights when there is one."""

from __future__ import annotations

from megatron import mpu
from megatron.training.features.base import Setup, step_saves_hooks
from megatron.training.loop import LoopHooks
from megatron.training.peft_saves import PeftSaves
from megatron.training.train_config import TrainConfig


def build_peft_saves(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None without ``lora_peft_save_path``."""
    keys = run.peft_saves
    if keys.lora_peft_save_path is None:
        return None
    adapters = [p for adapter in setup.eng.adapters for p in adapter.parameters()]
    saves = PeftSaves(keys, run.lora, setup.eng.config, base_model=setup.checkpoint_keys.initialize_from_hf,
                      weights=setup.saved_weights(adapters), writer=setup.rank == 0, agree=mpu.rank0_decides,
                      ema_beta=run.averaging.ema_beta)
    return step_saves_hooks("lora_peft_save_path", saves, setup.train_iters)
