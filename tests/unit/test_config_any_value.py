"""No value a user can type makes the pre-launch checks crash: every key, set to values of the
wrong type, sign or shape, gives a clean ConfigError (exit 2 at the entry) or is accepted."""

from __future__ import annotations

from typing import Any

import pytest

from megatron.errors import DeepyError
from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import detect_world_size, finalize
from megatron.config_rules import Device

MINIMAL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
               train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer")
ODD_VALUES: tuple[Any, ...] = ("abc", -5, [1, "x"], {"k": "v"}, 0, 1e30)


@pytest.mark.parametrize("group", sorted({NeoXArgs.group_of(k) for k in NeoXArgs.field_names()}))
def test_odd_values_are_config_errors_or_accepted(group: str) -> None:
    crashes = []
    for key in [k for k in NeoXArgs.field_names() if NeoXArgs.group_of(k) == group]:
        for value in ODD_VALUES:
            try:
                resolved = config_from_mapping({**MINIMAL, key: value})
                world = detect_world_size(resolved.args, device_count=1)
                finalize(resolved, world, device=Device(cuda=False, fp16_supported=False))
            except DeepyError:
                pass
            except Exception as err:  # noqa: BLE001 - exactly what this test hunts
                crashes.append(f"{key}={value!r}: {type(err).__name__}: {str(err)[:200]}")
    assert crashes == []
