"""A reward model starts from a language model's weights: only the parameters its objective declares
new may be missing (they keep their initialisation); anything else missing is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.checkpointing.new_parameters import tolerating_new_parameters
from megatron.errors import CheckpointError
from megatron.model import GPTConfig, GPTModel
from megatron.objectives.rm import RewardModelObjective

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64, seed=3,
              no_weight_tying=True)


def test_only_the_declared_new_parameters_may_be_missing() -> None:
    lm = GPTModel(GPTConfig(**CONFIG)).state_dict()
    rm = GPTModel(GPTConfig(**CONFIG).replace(value_head=True))
    head = rm.value_head.weight.detach().clone()
    engine = SimpleNamespace(module=rm)
    with tolerating_new_parameters(engine, RewardModelObjective.new_parameters) as report:
        rm.load_state_dict(lm, strict=True)  # what DeepSpeed's loader calls
    assert "load_state_dict" not in vars(rm)  # the module's own method is back
    assert torch.equal(rm.value_head.weight, head)
    assert all(torch.equal(rm.state_dict()[k], v) for k, v in lm.items() if not k.startswith("output_layer."))
    assert report.initialised == ["value_head.weight"] and report.dropped == ["output_layer.weight"]

    broken = {k: v for k, v in lm.items() if k != "final_norm.weight"}
    with pytest.raises(CheckpointError, match="lacks parameters this model needs .*: final_norm.weight"):
        with tolerating_new_parameters(engine, RewardModelObjective.new_parameters):
            rm.load_state_dict(broken)
    with pytest.raises(RuntimeError, match="value_head.weight"):  # without the declaration: strict as before
        rm.load_state_dict(lm)
