"""Every DeepSpeed internal megatron/deepspeed_internals.py touches still exists and behaves as that
module assumes (pinned DeepSpeed 0.19.8). A DeepSpeed upgrade that moves one fails here first."""

from __future__ import annotations

import os
import socket

import pytest
import torch


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    """A one-rank fp32 DeepSpeed engine on gloo, the kind the trainer builds."""
    import deepspeed
    import torch.distributed as dist

    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        skip_shared_memory_comm_op()
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return eng


def test_shared_memory_op_cache_is_a_dict_deepspeed_consults() -> None:
    import deepspeed.ops

    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    assert isinstance(deepspeed.ops.__compatible_ops__, dict)
    skip_shared_memory_comm_op()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False


def test_universal_flag_lives_on_the_engine_config(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import universal_loading

    before = engine._config.load_universal_checkpoint
    with universal_loading(engine, True):
        assert engine._config.load_universal_checkpoint is True
    assert engine._config.load_universal_checkpoint == before
    # DeepSpeed reads the flag through this accessor inside load_checkpoint
    assert engine.load_universal_checkpoint() == before


def test_fp32_clipping_hook_and_recorded_norm(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import replace_fp32_clipping

    assert callable(engine.clip_fp32_gradients)  # the method DeepSpeed calls at the step boundary
    replace_fp32_clipping(engine, lambda: 3.5)
    engine.clip_fp32_gradients()
    assert engine.get_global_grad_norm() == 3.5  # _global_grad_norm is what the public getter returns


def test_backward_allreduce_switch_is_honoured(engine) -> None:  # type: ignore[no-untyped-def]
    assert hasattr(engine, "enable_backward_allreduce")


def test_loss_scale_is_none_without_fp16(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import loss_scale

    assert loss_scale(engine) is None


def test_loss_scale_attribute_of_deepspeeds_fp16_optimizers() -> None:
    """FP16_Optimizer and the ZeRO optimizers expose the current scale as `cur_scale`."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (FP16_Optimizer, DeepSpeedZeroOptimizer):
        source = __import__("inspect").getsource(cls)
        assert "cur_scale" in source, cls


def test_checkpoint_engine_writes_through_save_and_makedirs(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import recorded_checkpoint_writes

    calls: list[str] = []
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.save

    def failing(state_dict, path):  # type: ignore[no-untyped-def]
        calls.append(path)
        raise OSError("disk full")

    ckpt_engine.save = failing
    try:
        with recorded_checkpoint_writes(engine) as errors:
            engine.save_checkpoint(str(tmp_path), "tag", save_latest=False)
    finally:
        ckpt_engine.save = original
    assert calls, "DeepSpeed no longer writes through checkpoint_engine.save"
    assert errors and "disk full" in str(errors[0])
    assert engine.checkpoint_engine.save == original


def test_model_parallel_rng_tracker_name_is_registered_by_our_seed() -> None:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from megatron.deepspeed_internals import model_parallel_rng_tracker_name

    assert model_parallel_rng_tracker_name() == checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME
    assert isinstance(model_parallel_rng_tracker_name(), str)


def test_shared_step_tensors_are_untied_so_each_group_counts_once() -> None:
    from types import SimpleNamespace

    from megatron.deepspeed_internals import untie_optimizer_steps

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    shared = torch.tensor(4.0)  # what DeepSpeed 0.19.8's ZeRO-3 universal loader leaves behind
    for param in (a, b):
        optimizer.state[param] = {"step": shared, "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.zeros_like(param)}
    untie_optimizer_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer)))
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in (a, b)] == [5.0, 5.0]  # tied, the one counter reads 6.0


def test_pipeline_tied_gradient_reduction_reads_every_tied_weight_grad() -> None:
    """skip_frozen_tied_gradients (LoRA) wraps this method: DeepSpeed all-reduces ``weight.grad`` of
    every tied weight, which a frozen weight does not have."""
    import inspect

    from deepspeed.pipe import PipelineModule

    source = inspect.getsource(PipelineModule.allreduce_tied_weight_gradients)
    assert "weight.grad" in source
    assert callable(PipelineModule.get_tied_weights_and_groups)


def test_pipeline_eval_adds_outputs_into_the_training_loss_total() -> None:
    """separate_pipeline_loss_total (LoRA reference pass) relies on: train_batch starts total_loss from
    None, and every forward on the last stage adds its loss_fn output into it."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "self.total_loss = None" in inspect.getsource(PipelineEngine.train_batch)
    assert "self.total_loss = add_to_total_loss(self.total_loss" in inspect.getsource(PipelineEngine._exec_forward_pass)
    assert "self.total_loss = None" not in inspect.getsource(PipelineEngine.eval_batch)
