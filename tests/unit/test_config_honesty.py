"""A key is honoured or refused, never accepted and ignored.

1. Every supported key is shown to do something by a test (``effect_index``: a test that observes
   behaviour names it; keys handed to DeepSpeed only count in tests that read DeepSpeed's own state),
   or ``honesty.NO_EFFECT_KEYS`` / ``FILLED_IN_KEYS`` list it with the reason. Being read by a
   component builder, or copied into the DeepSpeed JSON, is not enough: that is how the
   ``activation_checkpointing`` block and ``fp32_allreduce`` were accepted and ignored.
2. The check itself fails for a key that is merely copied (a test of the test, with a deliberately
   unread field).
3. Every field of every typed component config (all of them, found from ``RunConfig`` and the entry
   points) is read by code outside the ``from_args`` that fills it.
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

from effect_index import DEEPSPEED_STATE_TESTS, TestSource, effect_tests, naming_tests

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


# Keys handed to DeepSpeed (its config JSON, or deepspeed.checkpointing.configure): shown only by a test
# that reads DeepSpeed's resulting state.
FLAT_DEEPSPEED_KEYS = frozenset({
    "fp32_allreduce", "zero_stage", "zero_reduce_scatter", "zero_contiguous_gradients", "zero_reduce_bucket_size",
    "zero_allgather_bucket_size", "partition_activations", "contiguous_checkpointing", "checkpoint_in_cpu",
    "synchronize_each_layer", "profile_backward", "hysteresis", "loss_scale_window", "min_scale", "loss_scale",
    "dynamic_loss_scale",
})  # fmt: skip

EFFECT_NOT_YET_SHOWN: dict[str, str] = {
    "no_save_rng": "honoured (checkpointing/manager.py) but no test yet shows the RNG files left out",
    "no_load_rng": "honoured (checkpointing/save_load.py) but no test yet shows the streams not restored",
    "moe_lbl_in_fp32": "honoured (model/moe.py) but no test yet shows the fp32 balance loss of a bf16 router",
    "memory_profiling_path": "GPU only (CUDA memory snapshots; CPU runs refuse memory_profiling): no CPU test",
}
"""Known gaps, listed so they stay visible: each must still lack an effect test (remove it when one lands)."""


def deepspeed_keys() -> frozenset[str]:
    from megatron.neox_arguments.deepspeed_split import DS_CONFIG_KEYS

    return frozenset(DS_CONFIG_KEYS) | FLAT_DEEPSPEED_KEYS


def keys_without_effect_test(keys: set[str], tests: list[TestSource], deepspeed: frozenset[str]) -> list[str]:
    """The keys no test shows to have an effect (DeepSpeed's keys: no test reading DeepSpeed's state)."""
    missing = []
    for key in sorted(keys):
        found = naming_tests(key, tests)
        if key in deepspeed:
            found = [t for t in found if t in DEEPSPEED_STATE_TESTS]
        if not found:
            missing.append(key)
    return missing


def keys_needing_an_effect() -> set[str]:
    return {k for k in supported_keys() - set(NO_EFFECT_KEYS) - set(FILLED_IN_KEYS) if not only_default_accepted(k)}


@pytest.fixture(scope="module")
def tests_index() -> list[TestSource]:
    return effect_tests()


def test_every_supported_key_has_a_test_showing_its_effect(tests_index: list[TestSource]) -> None:
    missing = keys_without_effect_test(keys_needing_an_effect(), tests_index, deepspeed_keys())
    assert sorted(set(missing) - set(EFFECT_NOT_YET_SHOWN)) == [], (
        "no test shows what these keys do (a key copied into a typed config or the DeepSpeed JSON is not "
        "honoured until a test observes its effect; DeepSpeed's keys need a test reading DeepSpeed's state, "
        f"see tests/unit/effect_index.py): {sorted(set(missing) - set(EFFECT_NOT_YET_SHOWN))}. Write the test, or "
        "list the key in megatron/neox_arguments/honesty.py with the reason it changes nothing"
    )
    assert sorted(set(EFFECT_NOT_YET_SHOWN) - set(missing)) == [], "these now have an effect test: unlist them"


def test_a_key_that_is_only_copied_fails_the_check(tests_index: list[TestSource]) -> None:
    """The test of the test: a field every builder copies (so the old 'read by a component' criterion
    passes) but no test observes is reported; so is a DeepSpeed key named only by a test that does not
    read DeepSpeed's state, and a key whose only mention is in a refusal test."""
    from pydantic import create_model

    @dataclasses.dataclass(frozen=True)
    class CopyingConfig:
        deliberately_unread_key: int

    with_field = create_model("NeoXArgsWithUnread", __base__=NeoXArgs, deliberately_unread_key=(int, 3))
    args = with_field(**MINIMAL)
    from megatron.neox_arguments.honesty import ReadRecorder

    recorder = ReadRecorder(args)
    CopyingConfig(deliberately_unread_key=recorder.deliberately_unread_key)  # a from_args-style copy
    assert "deliberately_unread_key" in recorder.read  # the old criterion is satisfied by the copy

    copied_only = [*tests_index, TestSource("tests/unit/test_x.py::test_copy",
                                          "cfg = CopyingConfig.from_args(args)  # no mention of the key")]
    assert keys_without_effect_test({"deliberately_unread_key"}, copied_only, frozenset()) == \
        ["deliberately_unread_key"]
    named_elsewhere = [TestSource("tests/unit/test_x.py::test_json", "assert ds['deliberately_unread_key'] == 3")]
    assert keys_without_effect_test({"deliberately_unread_key"}, named_elsewhere,
                                    frozenset({"deliberately_unread_key"})) == ["deliberately_unread_key"]
    shown = [TestSource("tests/unit/test_x.py::test_effect", "run(deliberately_unread_key=4); assert loss != base")]
    assert keys_without_effect_test({"deliberately_unread_key"}, shown, frozenset()) == []
    # the real index ignores refusal-only tests and config-only files
    refusal = REPO / "tests" / "unit" / "test_config_rules.py"
    assert not any(t.node_id.startswith(str(refusal.relative_to(REPO))) for t in tests_index)


def test_lists_name_real_supported_keys() -> None:
    for key in [*NO_EFFECT_KEYS, *FILLED_IN_KEYS]:
        assert NeoXArgs.has_field(key), key
        assert NeoXArgs.is_supported(key), f"{key} is not_supported: it does not belong in the lists"
    assert not set(NO_EFFECT_KEYS) & set(FILLED_IN_KEYS)




def component_config_classes() -> list[type]:
    """Every typed config a component receives: RunConfig's, the entry points', and the dataclasses
    nested in them (LoggingConfig's tracker settings, ...). None is skipped."""
    import typing

    from megatron.evaluation.config import EvalConfig
    from megatron.generation.config import GenerationConfig
    from megatron.launcher.config import LaunchConfig
    from megatron.neox_arguments.run_config import RunConfig

    found: list[type] = []
    todo: list[type] = [RunConfig, LaunchConfig, GenerationConfig, EvalConfig]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:
                tp = stack.pop()
                if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                    todo.append(tp)
                stack.extend(typing.get_args(tp))
    return [cls for cls in found if cls is not RunConfig]  # RunConfig only bundles the others


def attribute_reads() -> set[str]:
    """Attribute names read anywhere in our code, except the flat ``args.x`` and inside ``from_args``
    (where a config copies keys in)."""
    import ast

    reads: set[str] = set()
    sources = [*(REPO / "megatron").rglob("*.py"), *(REPO / name for name in ("train.py", "generate.py", "eval.py"))]
    for path in sources:
        tree = ast.parse(path.read_text())
        skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "from_args"
                   for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in skipped and isinstance(node.ctx, ast.Load) \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "args"):
                reads.add(node.attr)
    return reads


def test_every_typed_config_field_is_used() -> None:
    """A field of a component config that no code reads would be a key honoured only on paper."""
    classes = component_config_classes()
    names = {cls.__name__ for cls in classes}
    assert {"LoggingConfig", "ObjectiveConfig", "GenerationConfig", "LaunchConfig", "DataConfig"} <= names, names
    reads = attribute_reads()
    unused = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls) if f.name not in reads]
    assert unused == [], f"typed config fields nothing reads outside their from_args: {unused}"
