"""Which keys the components read, for ``test_config_honesty.py`` (being read is necessary, not sufficient: the
test also wants a test that observes each key's effect). Derived, never listed by hand (issue 46): a key is read
when a component's source reads it as an attribute (``source_reads``), or when the builders here, run on a
recorder of attribute reads, read it by a route the source does not spell (a key read by name, the DeepSpeed
split, a layer reading its config as it runs). Test machinery, so it lives with the tests, above every layer it
builds.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

from megatron import plugins

from megatron.checkpointing.manager import CheckpointManager
from megatron.checkpointing.preemption import PreemptionWatcher
from megatron.errors import DeepyError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.deepspeed_split import deepspeed_config
from megatron.neox_arguments.derived import DERIVATIONS
from megatron.neox_arguments.honesty import ComponentBuilder, entry_point_builders
from megatron.neox_arguments.resolved import run_directory
from megatron.config_rules import RuleContext
from megatron.neox_arguments.run_config import RunConfig
from megatron.neox_arguments.component_groups import group
from megatron.tokenizer import build_tokenizer


_GROUP_COPY = group.__code__


class ReadRecorder:
    """Wraps the arguments and records every attribute read (writes pass through)."""

    def __init__(self, args: NeoXArgs) -> None:
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        # a copy into a component's own group instance (``component_groups.group``) is not a read: what the
        # component then reads of its instance is found in its source (``source_reads``)
        if name in type(self._args).model_fields and sys._getframe(1).f_code is not _GROUP_COPY:
            self.read.add(name)
            return getattr(self._args, name)
        # a group handed to its component whole (the LR schedule's keys) reads its keys in its own
        # methods and properties: run those on the recorder so their reads count
        attr = getattr(type(self._args), name, None)
        if isinstance(attr, property) and attr.fget is not None and _ours(attr.fget):
            return attr.fget(self)
        if inspect.isfunction(attr) and _ours(attr):
            return attr.__get__(self)
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


def _ours(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "")).startswith("megatron.")


def _tokenizer(args: Any) -> object:
    """What the ranks ask of the tokenizer keys (``pretrain``): the tokenizer, then its padded vocabulary."""
    try:
        vocab = build_tokenizer(args).vocab_size
    except DeepyError:
        vocab = 1  # a variant names files that are not there: the keys were read all the same
    return args.padded(vocab, 1)


def _model(args: Any) -> object:
    """What the trainer asks of the model keys (``pretrain``: ``for_tokenizer``, then ``build_engine``
    builds ``GPTModel`` from the arguments themselves): the model, and one forward of a few tokens (the
    keys a layer reads as it runs). The recorder itself is the config, so every read counts; the
    vocabulary is sized on it, as ``for_tokenizer`` sizes the trainer's copy."""
    import torch

    from megatron.model import GPTModel

    if args.padded_vocab_size is None:
        args.padded_vocab_size = 128
    model = GPTModel(args)
    with torch.no_grad():
        return model(torch.zeros((1, 4), dtype=torch.long))


def _checkpoints(args: Any) -> object:
    """What the trainer asks of the checkpoint keys (``pretrain``): the manager, and whether each save
    is validated by a forward pass. The watcher is not installed (no signal handlers in a test)."""
    manager = CheckpointManager.from_config(args, args_record={}, train_iters=int(args.train_iters or 100),
                                            preemption=PreemptionWatcher())
    return manager, args.checkpoint_validation_with_forward_pass




















def _run_config(args: Any) -> object:
    """What building the run's views refuses unless resolved (``RunConfig.__post_init__``)."""
    return RunConfig.from_args(args)










def _data(args: Any) -> object:
    """What ``build_datasets`` asks of each split's files and weights, read by name (``path_list(key)``,
    ``split_weights(split)``), so no attribute in the source names them; the other data keys are read as
    attributes (``source_reads``)."""
    from megatron.data.config import PATH_KEYS, SPLITS

    return [args.path_list(key) for key in PATH_KEYS], [args.split_weights(s) for s in SPLITS]


def _user_plugins(args: Any) -> object:
    """What each rank does with ``plugins`` before validating its resolved config (``load_resolved``)."""
    return plugins.load_user_plugins(args.plugins)






def component_builders() -> list[ComponentBuilder]:
    """What turns keys into what a component does by a route the source does not spell as attribute reads (the
    tokenizer and model built and run, the checkpoint manager, the data paths by name, the DeepSpeed split, the
    run directory, the user's plug-ins), for train.py; every other read is found in the source."""
    return [_run_config, _tokenizer, _model, _checkpoints, _data, _user_plugins, deepspeed_config, run_directory]


def plugin_keys_read() -> set[str]:
    """Keys a plug-in declares that its implementation reads (``.key``) — in its module's package, where
    the family's config (``objectives.registry.reference_kind``) and the plug-in's check live too: a plug-in is
    handed its keys whole (the arguments object, ``ScheduleSpec.options``), so what it reads is in its
    source."""
    read: set[str] = set()
    for plugin in plugins.all_plugins():
        if plugin.keys is None:
            continue
        module_file = Path(inspect.getfile(plugin.resolve()))
        package = module_file.parent.glob("*.py") if module_file.parent.joinpath("__init__.py").exists() else [module_file]
        source = "\n".join(path.read_text(encoding="utf-8") for path in package)
        read |= {key for key in plugin.keys.model_fields if re.search(rf"\.{key}\b|option\(\"{key}\"\)", source)}
    return read


# Settings under which the builders read their conditional keys (a key read only when a feature is
# on, e.g. wandb_project when use_wandb): the harness builds each of these variants too.
FEATURE_VARIANTS: tuple[dict[str, Any], ...] = (
    {"use_wandb": True},
    {"text_gen_type": "unconditional", "eval_tasks": ["task"]},
    {"cycles": 2},  # rewarmup shapes the cycles after the first
    {"lora_r": 4},  # the adapters' other keys shape the adapters
    {"skip_bad_steps_window": 8},  # the sigma shapes the rule
    {"reinit_tokens": ["a"]},  # which matrices are re-drawn
    {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "absent-vocab.json"},  # GPT-2 BPE reads both files
    {"train_impl": "dpo"},  # an objective with a reference reads where it comes from (reference_logps)
    # architectures whose layers read their own keys: rotary, RMSNorm, the parallel residual, MoE layers
    # (apart: GPT-NeoX's parallel residual drops the attention output in MoE layers, which Deepy refuses)
    {"pos_emb": "rotary", "norm": "rmsnorm", "moe_num_experts": 2},
    {"pos_emb": "rpe", "norm": "scalenorm", "gpt_j_residual": True},  # the relative position bias, ScaleNorm
    # the other layer families read their own keys (megatron/model/family_config.py)
    {"num_layers": 3, "attention_config": [[["mamba", "rwkv", "amlp"], 1]], "head_size": 16, "ffn_dim": 224},
)


ARGUMENT_LAYER = ("megatron/neox_arguments/", "megatron/config_rules.py", "megatron/config_schema.py")
"""Code that checks, derives and documents keys rather than honouring them: a read there does not count."""


def source_reads(names: set[str]) -> set[str]:
    """Keys of ``names`` a component's code reads as an attribute (``config.log_interval``, ``self.lora_r`` in the
    group's own methods), anywhere in ``megatron/`` outside the argument layer: derived from the source, so a key
    added to a group and read by its component needs no table here (issue 46)."""
    repo = Path(__file__).resolve().parents[2]
    source = "\n".join(path.read_text(encoding="utf-8") for path in sorted((repo / "megatron").rglob("*.py"))
                       if not path.relative_to(repo).as_posix().startswith(ARGUMENT_LAYER))
    attributes = set(re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)\b", source))
    return names & attributes


def keys_read(args: NeoXArgs, world_size: int = 1) -> set[str]:
    """Keys the component builders (train.py's and the other entry points') and the derivations
    read from ``args`` (a finalized config) and from its FEATURE_VARIANTS."""
    recorder = ReadRecorder(args)
    ctx = RuleContext(args=recorder, world_size=world_size)  # type: ignore[arg-type]
    for derive in DERIVATIONS:
        derive(ctx)
    read = set(recorder.read)
    for variant in ({}, *FEATURE_VARIANTS):
        variant_recorder = ReadRecorder(args.model_copy(update=variant))
        for build in component_builders():
            build(variant_recorder)
        if variant:
            for build in entry_point_builders().values():
                try:
                    build(variant_recorder)
                except DeepyError:
                    pass  # the variant does not suit this entry point; its reads so far still count
        read |= variant_recorder.read
    return read | plugin_keys_read() | source_reads(set(type(args).model_fields))
