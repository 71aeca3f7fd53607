"""Single-process pieces of the trainer: batches, grad-norm clipping, overflow policy, layer
selection for checkpointing, pipeline partition names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.errors import ConfigError
from megatron.model.pipeline import BLOCK_PARTITION
from megatron.neox_arguments import NeoXArgs, config_from_mapping
from megatron.training.activation_config import ActivationCheckpointArgs
from megatron.training.config import TrainingLoopArgs, TrainingRunArgs
from megatron.training.engine import clip_grad_norm, layers_to_checkpoint, partition_method
from megatron.training.loop import TrainingAborted, TrainState, _check_overflow
from megatron.training.objectives.base import IGNORE_INDEX, shifted
from megatron.training.step import StepResult


def test_shifted_inputs_and_masked_labels() -> None:
    text = torch.tensor([[5, 6, 7, 0, 9]])
    tokens, labels = shifted({"text": text}, "text", "label", eod_token=0)
    assert tokens.tolist() == [[5, 6, 7, 0]]
    assert labels.tolist() == [[6, 7, IGNORE_INDEX, 9]]  # predicting the eod is not counted
    _, labels = shifted({"text": text, "label": torch.tensor([[-100, -100, 7, 3, 9]])}, "text", "label", None)
    assert labels.tolist() == [[IGNORE_INDEX, 7, 3, 9]]


def test_clip_grad_norm_matches_torch_and_clips() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    for model in (a, b):
        model(torch.randn(4, 8)).pow(2).sum().backward()
    params = [*a.parameters(), *b.parameters()]
    reference = [p.grad.clone() for p in params]
    expected = torch.nn.utils.get_total_norm(reference)
    norm = clip_grad_norm(params, max_norm=0.5)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    assert float(clipped) == pytest.approx(0.5, rel=1e-4)


def test_clip_skips_pipeline_replicas_of_tied_weights() -> None:
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    q.ds_pipe_replicated = True  # the copy DeepSpeed keeps on a non-owner stage
    assert clip_grad_norm([p, q], max_norm=0.0) == pytest.approx(5.0)


def _result(applied: bool) -> StepResult:
    return StepResult(loss=1.0, applied=applied, grad_norm=None, loss_scale=1.0)


def test_overflow_counting_and_abort() -> None:
    state = TrainState()
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(True), limit=3)  # a good step resets the streak
    assert state.skipped_steps == 2 and state.consecutive_overflows == 0
    _check_overflow(state, _result(False), limit=3)
    _check_overflow(state, _result(False), limit=3)
    with pytest.raises(TrainingAborted, match="max_consecutive_overflows"):
        _check_overflow(state, _result(False), limit=3)


def test_train_state_round_trip() -> None:
    state = TrainState(iteration=7, consumed_samples=56)
    assert TrainState.from_dict({**state.to_dict(), "unknown": 1}) == state


def _ckpt(**values: object) -> ActivationCheckpointArgs:
    return config_from_mapping(values).args


def test_layers_to_checkpoint() -> None:
    assert layers_to_checkpoint(_ckpt(checkpoint_activations=True), 4) == [0, 1, 2, 3]
    every_other = _ckpt(checkpoint_activations=True, selective_checkpointing=2)
    assert layers_to_checkpoint(every_other, 4) == [0, 2]
    # on a later pipeline stage holding global layers 3..5
    assert layers_to_checkpoint(every_other, 3, first_index=3) == [1]
    assert layers_to_checkpoint(_ckpt(), 4) == []


def test_activation_block_is_another_spelling_of_the_flat_keys() -> None:
    """DeepSpeed's ``activation_checkpointing`` block turns an option on as its flat key does, and only
    it sets ``number_checkpoints`` (else one buffer per layer)."""
    flat = _ckpt(checkpoint_activations=True, partition_activations=True).deepspeed_checkpointing_options(6)
    block = _ckpt(checkpoint_activations=True, activation_checkpointing={
        "partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3,
    }).deepspeed_checkpointing_options(6)
    assert (flat["partition_activations"], flat["checkpoint_in_cpu"], flat["num_checkpoints"]) == (True, False, 6)
    assert (block["partition_activations"], block["checkpoint_in_cpu"], block["num_checkpoints"]) == (True, True, 3)


def test_the_loops_protocol_names_declared_keys_and_every_loop_key() -> None:
    """``RunConfig.training`` is the arguments typed as ``TrainingRunArgs``: each name it lists is a
    declared key, and it lists every key of the loop's own group."""
    members = {name for name, value in vars(TrainingRunArgs).items() if isinstance(value, property)}
    assert set(TrainingLoopArgs.model_fields) <= members <= set(NeoXArgs.model_fields)


def test_partition_method_names() -> None:
    assert partition_method("type:transformer|mlp") == BLOCK_PARTITION  # blocks of every family
    assert partition_method("parameters") == "parameters"
    assert partition_method("type:Embedding") == "type:Embedding"
    with pytest.raises(ConfigError, match="pipe_partition_method"):
        partition_method("balanced")


def test_micro_batches_from_sampler_feed_the_shift() -> None:
    from megatron.data.sampler import collate

    samples = [{"text": np.arange(5, dtype=np.int64) + i} for i in range(2)]
    tokens, _ = shifted(collate(samples), "text", "label", None)
    assert tokens.shape == (2, 4) and tokens.dtype == torch.int64
