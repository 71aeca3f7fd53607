"""The split: DeepSpeed config dict (with deepspeed_extra_args) and the runner's command-line flags."""

from __future__ import annotations

from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.deepspeed_split import deepspeed_config
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.config_rules import Device

CPU = Device(cuda=False, fp16_supported=False)
BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 128,
    "train_micro_batch_size_per_gpu": 4,
    "train_iters": 10,
    "use_dummy_dataset": True,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
}


def finalized(world: int = 1, **values: Any) -> ResolvedConfig:
    merged = {**BASE, **values}
    merged.setdefault("tokenizer_type", "CharLevelTokenizer")  # dummy data still needs a tokenizer
    provenance = {key: f"ds.yml:{line}" for line, key in enumerate(merged, start=1)}
    return finalize(ResolvedConfig(args=NeoXArgs(**merged), provenance=provenance), world, device=CPU)


def test_config_has_batch_precision_zero_and_no_optimizer() -> None:
    config = finalized(world=2, gradient_accumulation_steps=2, bf16={"enabled": True}, zero_stage=1,
                       clip_grad=0.5, wall_clock_breakdown=True).deepspeed_config
    assert config["train_batch_size"] == 16
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 2
    assert config["bf16"] == {"enabled": True}
    assert "fp16" not in config
    assert config["zero_optimization"] == {"stage": 1}
    assert config["zero_allow_untested_optimizer"] is True
    assert config["gradient_clipping"] == 0.5  # clip_grad is the same setting
    assert config["wall_clock_breakdown"] is True
    assert "optimizer" not in config and "scheduler" not in config


def test_deepspeed_accepts_the_generated_config() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    config = finalized(world=1, gradient_accumulation_steps=3, bf16={"enabled": True},
                       zero_optimization={"stage": 2, "overlap_comm": True},
                       deepspeed_extra_args={"memory_breakdown": False}).deepspeed_config
    parsed = DeepSpeedConfig(config)
    assert parsed.train_batch_size == 12
    assert parsed.gradient_accumulation_steps == 3
    assert parsed.zero_optimization_stage == 2
    assert parsed.bfloat16_config.enabled


def test_extra_args_are_merged() -> None:
    config = finalized(deepspeed_extra_args={"memory_breakdown": True, "steps_per_print": 5}).deepspeed_config
    assert config["memory_breakdown"] is True
    assert config["steps_per_print"] == 5  # top-level key left at its default: the extra value wins


def test_key_given_both_ways_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        finalized(steps_per_print=20, deepspeed_extra_args={"steps_per_print": 5})
    message = err.value.message
    assert "steps_per_print is given both as a top-level key (ds.yml:9) and in deepspeed_extra_args (ds.yml:10)" in message


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"train_batch_size": 64}, "train_batch_size is given both as a top-level key (derived)"),
        ({"bf16": {"enabled": True}}, "deepspeed_extra_args.bf16 (ds.yml:9): set bf16 as a top-level key"),
        ({"optimizer": {"type": "Adam"}}, "deepspeed_extra_args.optimizer (ds.yml:9): Deepy builds the optimizer"),
    ],
)
def test_extra_args_cannot_bypass_deepy(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        finalized(deepspeed_extra_args=extra)
    assert needle in err.value.message


def test_deepspeed_config_refuses_conflicts_when_called_directly() -> None:
    args = NeoXArgs(steps_per_print=3, deepspeed_extra_args={"steps_per_print": 4})
    with pytest.raises(ConfigError, match="given both"):
        deepspeed_config(args)


def test_blocks_deepspeed_removed_never_reach_it() -> None:
    # DeepSpeed 0.19.8 raises on a leftover sparse_gradients key, even set to false
    config = finalized().deepspeed_config
    for key in ("sparse_gradients", "amp", "curriculum_learning", "sparse_attention", "elasticity"):
        assert key not in config
    from megatron.neox_arguments import config_from_mapping

    with pytest.raises(ConfigError, match="sparse_gradients: True is obsolete: DeepSpeed 0.19.8 removed"):
        config_from_mapping({"sparse_gradients": True})  # refused by the schema: DeepSpeed 0.19.8 removed it
    with pytest.raises(ConfigError, match="deepspeed_extra_args.elasticity .*DeepSpeed refuses it"):
        finalized(deepspeed_extra_args={"elasticity": {"enabled": True}})
