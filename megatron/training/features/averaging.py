"""``ema_beta`` as a feature: the EMA of the weights (``model_averaging.ModelAverage``), updated after every step
before the step's checkpoint (which writes it: ``deepy_ema/``), read back from the loaded checkpoint (else started
at the starting weights), evaluated beside the weights (``eval/ema/...``), and the weights the lm-eval tasks run on
and the PEFT and HF saves write (Levanter's ``eval_model``)."""

from __future__ import annotations

from megatron import mpu
from megatron.engine.build import Engine
from megatron.training.features.base import Setup
from megatron.training.loop import EvalWeights, LoopHooks, TrainState
from megatron.training.model_averaging import ModelAverage
from megatron.training.train_config import TrainConfig


def build_averaging(run: TrainConfig, setup: Setup) -> LoopHooks | None:
    """None without ``ema_beta``."""
    beta = run.averaging.ema_beta
    if beta is None:
        return None
    eng = setup.eng
    average = ModelAverage(
        eng.engine.module, beta, optimizer=eng.engine.optimizer,
        layout={"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipe_parallel_world_size(),
                "pipeline": eng.is_pipe},
        place=f"tp{mpu.get_tensor_model_parallel_rank():02d}_pp{mpu.get_pipe_parallel_rank():02d}",
        writer=mpu.get_data_parallel_rank() == 0)
    manager = setup.checkpoints.manager
    manager.rank_files.append(average.save)  # every checkpoint holds the average

    def resume(_eng: Engine, _state: TrainState) -> None:
        if not (manager.resumed_from is not None and average.load(manager.resumed_from)):
            average.restart()  # the weights this run starts from (loaded ones included) begin the average

    return LoopHooks(name="ema", resume=resume, after_update=lambda _eng, _state: average.update(),
                     eval_weights=EvalWeights(tag="ema", swapped_in=average.swapped_in, whole=average.whole))
