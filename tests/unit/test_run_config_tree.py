"""The run's config is a tree of the components' own groups (issue 46): every part of ``RunConfig`` a component
receives is an instance of the group declared beside it holding that group's keys and nothing else (a group
whose key selects a plug-in also holds the plug-ins' keys), never the flat object of every key."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from megatron.config_schema import ArgGroup
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.run_config import RunConfig
from megatron import plugins
from megatron.engine.engine_config import EngineConfig
from megatron.objectives.config import ObjectiveArgs
from megatron.training.train_config import TrainConfig

MINIMAL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, train_iters=10, lr=1e-3,
               train_micro_batch_size_per_gpu=2, use_dummy_dataset=True, tokenizer_type="CharLevelTokenizer",
               train_impl="dpo", dpo_beta=0.25, eval_tasks=["task"], ema_beta=0.9)


def _parts(node: Any, path: str = "run") -> list[tuple[str, Any]]:
    """Every group instance in the tree under ``node``, with its path (``run.data.keys``)."""
    if isinstance(node, BaseModel):
        return [(path, node)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [part for f in dataclasses.fields(node) for part in _parts(getattr(node, f.name), f"{path}.{f.name}")]
    return []


def test_every_part_is_its_own_group_and_holds_only_its_keys() -> None:
    run = RunConfig.from_mapping(MINIMAL)
    parts = _parts(run)
    assert len(parts) >= 20
    all_keys = set(NeoXArgs.model_fields)
    for path, part in parts:
        assert not isinstance(part, NeoXArgs), path
        assert isinstance(part, ArgGroup), path
        fields = set(type(part).model_fields)
        assert fields < all_keys and len(fields) < len(all_keys) / 2, (path, len(fields))
    # one instance per part (lm-eval's view is built apart): no part is another part's object
    own = [part for path, part in parts if not path.startswith("run.tasks")]
    assert len({id(part) for part in own}) == len(own)


def test_values_and_what_the_user_set_come_through() -> None:
    run = RunConfig.from_mapping(MINIMAL)
    assert (run.model.hidden_size, run.model.num_layers, run.averaging.ema_beta) == (64, 2, 0.9)
    assert "hidden_size" in run.model.model_fields_set and "num_kv_heads" not in run.model.model_fields_set
    assert run.data.keys.use_dummy_dataset is True and not hasattr(run.data.keys, "hidden_size")
    assert run.tasks is not None and run.tasks.evaluation.eval_tasks == ["task"]


def test_the_objective_holds_the_plug_ins_keys_it_selects_among() -> None:
    run = RunConfig.from_mapping(MINIMAL)
    objective_keys = [keys for name, keys in plugins.key_groups() if name.startswith("train_impl:")]
    assert len(objective_keys) >= 2  # DPO's and KTO's
    assert isinstance(run.objective, ObjectiveArgs)
    assert all(isinstance(run.objective, keys) for keys in objective_keys)  # whichever is chosen
    assert getattr(run.objective, "dpo_beta") == 0.25
    assert not hasattr(run.model, "dpo_beta")


def test_the_nodes_hold_groups_not_keys() -> None:
    """The engine's node is the trainer's is the root's: each field a group, a frozen object of groups and shared
    values, or the run's record (the DeepSpeed dict, every key as JSON, the name)."""
    assert issubclass(RunConfig, TrainConfig) and issubclass(TrainConfig, EngineConfig)
    run = RunConfig.from_mapping(MINIMAL)
    records = {"deepspeed_config", "args_record", "run_name"}
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        assert f.name in records or isinstance(value, ArgGroup) or dataclasses.is_dataclass(value), f.name
        assert f.name not in NeoXArgs.model_fields or f.name == "checkpoint", f.name  # DeepSpeed's block, apart
