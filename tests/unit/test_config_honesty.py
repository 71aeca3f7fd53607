"""A key is honoured or refused, never accepted and ignored.

1. Every supported key is read by a component builder (``RunConfig.from_args``, the DeepSpeed
   split, the launcher) or a derivation, or is listed with its reason in ``honesty.NO_EFFECT_KEYS`` /
   ``FILLED_IN_KEYS``. The reads are recorded on the real builders, so a new key nobody reads, or
   a builder that stops reading one, fails here.
2. Every field of every typed component config is used by code outside its ``from_args``.
3. For keys whose effect is observable on CPU, ``EFFECT_TESTS`` names the test that shows setting
   the key changes behaviour; those tests must exist.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.honesty import FILLED_IN_KEYS, NO_EFFECT_KEYS, keys_read, only_default_accepted
from megatron.neox_arguments.rules import Device

REPO = Path(__file__).resolve().parents[2]
MINIMAL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
               train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")


def supported_keys() -> set[str]:
    return {name for name in NeoXArgs.field_names() if NeoXArgs.is_supported(name)}


def test_every_supported_key_is_read_by_a_component() -> None:
    resolved = finalize(config_from_mapping(MINIMAL), 1, device=Device(cuda=False, fp16_supported=False))
    read = keys_read(resolved.args)
    unread = sorted(k for k in supported_keys() - read - set(NO_EFFECT_KEYS) - set(FILLED_IN_KEYS)
                    if not only_default_accepted(k))
    assert unread == [], (
        f"these keys are accepted but no component reads them: {unread}. Read each in a component's "
        f"from_args, or mark it not_supported in the schema, or (kernel hints only) list it in "
        f"megatron/neox_arguments/honesty.py with the reason"
    )


def test_lists_name_real_supported_keys() -> None:
    for key in [*NO_EFFECT_KEYS, *FILLED_IN_KEYS]:
        assert NeoXArgs.has_field(key), key
        assert NeoXArgs.is_supported(key), f"{key} is not_supported: it does not belong in the lists"
    assert not set(NO_EFFECT_KEYS) & set(FILLED_IN_KEYS)


def _component_classes() -> list[type]:
    from megatron.neox_arguments.run_config import RunConfig

    return [f.type if isinstance(f.type, type) else None for f in dataclasses.fields(RunConfig)]


def test_every_typed_config_field_is_used() -> None:
    """A field of a component config that no code reads would be a key honoured only on paper."""
    from megatron.checkpointing.config import CheckpointConfig
    from megatron.data.config import DataConfig
    from megatron.model.config import GPTConfig
    from megatron.mpu.config import ParallelConfig
    from megatron.tokenizer.config import TokenizerConfig
    from megatron.training.config import ActivationCheckpointConfig, LRConfig, OptimizerConfig, TrainingConfig

    sources = {p: p.read_text() for p in (REPO / "megatron").rglob("*.py")}
    sources[REPO / "train.py"] = (REPO / "train.py").read_text()
    unused = []
    for cls in (ParallelConfig, GPTConfig, TokenizerConfig, DataConfig, TrainingConfig, OptimizerConfig,
                LRConfig, ActivationCheckpointConfig, CheckpointConfig):
        for f in dataclasses.fields(cls):
            pattern = re.compile(rf"\.{f.name}\b")
            # a read is `x.name` anywhere; the builder's `name=args.name` line alone does not count
            hits = [
                line for text in sources.values() for line in text.splitlines()
                if pattern.search(line) and not re.match(rf"\s*{f.name}=args\.", line)
            ]
            if not hits:
                unused.append(f"{cls.__name__}.{f.name}")
    assert unused == [], f"typed config fields nothing reads: {unused}"


# key -> the test (file::function) that shows setting it changes what a run does
EFFECT_TESTS: dict[str, str] = {
    "mmap_warmup": "tests/unit/test_config_effects.py::test_mmap_warmup_reads_every_data_file",
    "checkpoint_validation_with_forward_pass": "tests/e2e/test_checkpoint_validation.py::test_checkpoint_validation_reloads_and_compares",
    "override_lr_scheduler": "tests/unit/test_lr_schedules.py::test_resuming_with_another_schedule_follows_the_override_keys",
    "use_checkpoint_lr_scheduler": "tests/unit/test_lr_schedules.py::test_resuming_with_another_schedule_follows_the_override_keys",
    "hysteresis": "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
    "loss_scale_window": "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
    "min_scale": "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
    "loss_scale": "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
    "dynamic_loss_scale": "tests/unit/test_config_effects.py::test_loss_scaling_keys_reach_deepspeed",
    "peak_theoretical_tflops": "tests/unit/test_config_effects.py::test_peak_tflops_override",
    "attention_config": "tests/unit/test_model_variants.py::test_attention_config_expands_like_gpt_neox",
    "weight_decay": "tests/unit/test_optimizers.py::test_weight_decay_in_params_is_honoured",
    "optimizer": "tests/unit/test_optimizers.py::test_each_optimizer_reduces_a_quadratic",
    "train_data_paths": "tests/unit/test_blending.py::test_build_blend_from_train_paths",
    "git_hash": "tests/unit/test_config_effects.py::test_git_hash_is_recorded",
    "scale_attn_by_inverse_layer_idx": "tests/unit/test_gpt2_options.py::test_attention_equals_transformers_gpt2",
}


@pytest.mark.parametrize("key", sorted(EFFECT_TESTS))
def test_effect_test_exists(key: str) -> None:
    assert NeoXArgs.is_supported(key), key
    path, _, name = EFFECT_TESTS[key].partition("::")
    text = (REPO / path).read_text()
    assert re.search(rf"^def {re.escape(name)}\(", text, re.M), f"{EFFECT_TESTS[key]} does not exist"
