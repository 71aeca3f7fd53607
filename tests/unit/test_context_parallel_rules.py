"""context_parallel_size before launch: the world and batch arithmetic, and what it refuses by name."""

from __future__ import annotations

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.honesty import check_entry_point
from megatron.config_rules import Device

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
            train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
            pos_emb="rotary", context_parallel_size=2)
DEVICE = Device(cuda=False, fp16_supported=False)


def _finalize(world: int, **changes: object):  # noqa: ANN202
    return finalize(config_from_mapping({**BASE, **changes}), world, device=DEVICE)


def test_context_parallel_ranks_read_the_same_samples() -> None:
    """world 8 = tp2 x cp2 x dp2: the global batch is micro x accumulation x dp (2), not x 4."""
    resolved = _finalize(8, model_parallel_size=2, train_batch_size=8)
    assert resolved.args.gradient_accumulation_steps == 2
    assert resolved.args.train_batch_size == 8
    assert resolved.deepspeed_config["train_batch_size"] == 8  # the engine multiplies it by cp for DeepSpeed


@pytest.mark.parametrize("changes, named", [
    (dict(seq_length=33, max_position_embeddings=33), "does not divide seq_length"),
    (dict(num_kv_heads=1), "multiples of 2"),
    (dict(model_parallel_size=2, num_gpus=4, hidden_size=96, num_attention_heads=6), "multiples of 4"),
    (dict(train_impl="dpo"), "train_impl"),
    (dict(sequence_parallel=True, model_parallel_size=2), "sequence_parallel"),
    (dict(pos_emb="rpe"), "pos_emb"),
    (dict(moe_num_experts=2), "moe_num_experts"),
])
def test_what_context_parallelism_cannot_split_is_refused(changes: dict, named: str) -> None:
    world = int(changes.get("num_gpus", 2))  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="context_parallel_size") as err:
        _finalize(world, **changes)
    assert named in str(err.value)


def test_world_must_split_into_tp_pp_cp() -> None:
    with pytest.raises(ConfigError, match="context_parallel_size"):
        _finalize(3)


def test_generation_refuses_context_parallelism() -> None:
    resolved = _finalize(2, text_gen_type="unconditional")
    with pytest.raises(ConfigError, match="context_parallel_size=2.*generate.py"):
        check_entry_point(resolved.args, "generate.py")
