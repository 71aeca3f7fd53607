"""Which keys the component builders read: the recorder ``test_config_honesty.py`` runs every
supported key through (being read is necessary, not sufficient: the test also wants a test that
observes each key's effect). Test machinery, so it lives with the tests, above every layer it
builds: the derivations, ``RunConfig``, the DeepSpeed split, the launcher and the other entry points.
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
from megatron.engine.build import layers_to_checkpoint
from megatron.objectives.registry import reference_kind


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


def _logging(args: Any) -> object:
    """What the trainer and the monitor ask of the logging keys (``pretrain``, ``build_monitor``,
    ``Monitor.is_log_step``; the memory estimate before launch reads device_memory_gb and
    allow_memory_overcommit)."""
    return (args.tracker_settings(), args.stats_settings, args.profile_settings(), args.log_interval,
            args.log_dir, args.deepspeed_log_level, args.peak_theoretical_tflops, args.device_memory_gb,
            args.allow_memory_overcommit)


def _lora(args: Any) -> object:
    """What the model builder and each adapter ask of the adapter keys (``build_model``, ``LoRAAdapter``)."""
    if not args.lora_enabled:
        return None
    return (args.lora_r, args.lora_scale, args.lora_dropout, args.lora_target_modules, args.lora_split_fused,
            args.lora_init)


def _lr_schedule(args: Any) -> object:
    """What the trainer asks of the LR keys (``engine.build_engine``): the schedule and the resume policy."""
    return args.spec(int(args.train_iters or 100), 1e-3), args.resume_policy


def _optimizer(args: Any) -> object:
    """What the trainer asks of the optimizer keys (``engine.build_engine``, ``optimizers.build_optimizer``)."""
    return (args.optimizer_kind, args.optimizer_type_shown, args.peak_lr, args.applied_weight_decay, args.optimizer_params,
            args.weight_decay_embeddings)  # param_groups


def _activation_checkpointing(args: Any) -> object:
    """What ``engine.build_model``/``wrap_layers``/``configure_activation_checkpointing`` ask of the
    activation checkpointing keys."""
    return (args.recomputes_activations, layers_to_checkpoint(args, 4), args.checkpoint_num_layers,
            args.deepspeed_checkpointing_options(4))


def _training_loop(args: Any) -> object:
    """What the loop reads of its keys (``pretrain.pretrain``, ``loop.train``),
    each where that code reads it: the loop is handed the frozen ``RunConfig.training`` (``training_run``),
    whose loop keys are the arguments themselves."""
    from megatron.neox_arguments.run_config import training_run

    training = training_run(args)
    loop = training.loop
    return (loop.train_iters, loop.train_epochs,  # pretrain.resolve_train_iters
            loop.eval_interval, loop.exit_interval, loop.max_consecutive_overflows,  # loop.train
            loop.eval_iters, loop.num_workers, training.seed, training.precision, training.seq_length,  # pretrain
            loop.max_train_epochs, loop.eval_micro_batch_size_per_gpu,  # pretrain: end reason, eval batches
            training.batch.on(dp=1))  # pretrain's batch layout


def _engine(args: Any) -> object:
    """What the engine builder and the memory estimate read of the engine's keys and the shared values
    (``build.build_engine``, ``build.build_model``, ``memory.MemoryLayout.from_run``; generation's
    ``build_inference_model``): they are handed the frozen ``RunConfig.engine`` (``engine_run``), whose engine
    keys are the arguments themselves."""
    from megatron.neox_arguments.run_config import engine_run

    engine = engine_run(args)
    return (engine.keys.compile_layers, engine.keys.zero_init, engine.seq_length, engine.precision, engine.seed,
            engine.batch.on(dp=1), engine.train_iters)


def _step_policies(args: Any) -> object:
    """What ``pretrain`` asks of the weight average's, the bad-step rule's, the token re-drawing's, the PEFT
    saves' keys (``PeftSaves``) and the HF saves' (``HFSaves``, ``hf_saves.save_dtype``)."""
    return (args.ema_beta, args.bad_step_rule(), args.reinit_tokens, args.redrawn(tied=False),
            args.lora_peft_save_path, args.lora_peft_save_interval, args.lora_peft_names,
            args.hf_save_path, args.hf_save_interval, args.hf_save_dtype)


def _hang_watch(args: Any) -> object:
    """What each rank's hang watch and start-up read (train.py's ``watch_for_hangs``, ``initialize``): the rank is
    handed the arguments typed as ``HangArgs`` (``RunConfig.hang``)."""
    return (args.hang_limits(), args.init_timeout_seconds, args.train_timeout_seconds,
            args.straggler_factor, args.straggler_window)  # the loop's straggler watch (pretrain)


def _run_config(args: Any) -> object:
    """What building the run's views refuses unless resolved (``RunConfig.__post_init__``)."""
    return RunConfig.from_args(args)


def _parallel(args: Any) -> object:
    """What each rank's start-up and the model builder ask of the keys that split the run over ranks
    (``initialize.initialize``/``init_distributed``, ``engine.build_model``, the memory estimate): the
    rank is handed the frozen ``RunConfig.parallel`` (``parallel_run``), which reads them all."""
    from megatron.neox_arguments.run_config import parallel_run

    return parallel_run(args)


def _launch(args: Any) -> object:
    """What deepy.py's launcher asks of its keys (``plan_launch`` and the launcher kinds, handed the
    arguments typed as ``DeepSpeedRunnerArgs`` and ``LoggingArgs``), and whether the user chose ``master_port``."""
    from megatron.launcher.config import master_port_chosen

    return (args.launcher, args.hostfile, args.include, args.exclude, args.num_nodes, args.num_gpus,  # resources
            args.master_addr, master_port_chosen(args), args.force_multi, args.no_ssh_check,  # rendezvous, runner
            args.comment, args.account, args.deepspeed_slurm, args.deepspeed_mpi,  # srun, in place
            args.deepspeed_log_level,  # runner flags
            args.slurm_requeue, args.max_requeues_without_progress,  # after the launch (deepy.py's requeue_if_stopped)
            args.max_restarts,  # after a failed launch (megatron/launcher/restarts.py)
            args.initialize_from_hf)  # converted before launch (deepy.py's hf_start)


def _objective(args: Any) -> object:
    """What the objective reads of its keys (``build_objective``, ``Objective.__init__``, ``LMObjective``,
    ``RewardModelObjective``, ``build_reference``), each where that code reads it: the objective is
    handed the arguments themselves (``RunConfig.objective``)."""
    return (args.train_impl, args.eod_mask_loss, args.z_loss, args.reset_attention_mask, args.reset_position_ids,
            reference_kind(args))


def _data(args: Any) -> object:
    """What ``build_datasets`` asks of the data keys (``pretrain``, ``data/build.py``): the sample
    counts, each split's files and weights, the source and how documents become samples. The datasets
    get the frozen ``RunConfig.data`` (``data_run``), whose data keys are the arguments themselves."""
    from megatron.data.build import samples_needed
    from megatron.data.config import PATH_KEYS, SPLITS
    from megatron.neox_arguments.run_config import data_run

    data = data_run(args)
    keys = data.keys
    return (samples_needed(data.train_batch_size, data.train_iters, data.eval_iters, data.eval_interval,
                           data.eval_batch_size),
            [keys.path_list(key) for key in PATH_KEYS], [keys.split_weights(s) for s in SPLITS],
            keys.use_dummy_dataset, keys.train_urls, keys.validation_urls, keys.cache_dir, keys.data_path, keys.split,
            keys.weight_by_num_documents, keys.weighted_sampler_alpha, keys.pack_impl, keys.allow_chopped,
            data.wants_pairs, data.reference_model, keys.mmap_warmup, data.seq_length, data.seed, data.train_epochs,
            data.max_train_epochs,  # build_datasets' epoch cap
            keys.dummy_data, keys.dummy_data_vocab_size,  # build_datasets' dummy data
            keys.shard_file_type, keys.shard_column, keys.shard_tokenizer, keys.shard_eos_token,  # token-shard
            keys.shard_bos_token, keys.shard_strip_tokens)  # directories (_read_shard_directory)


def _user_plugins(args: Any) -> object:
    """What each rank does with ``plugins`` before validating its resolved config (``load_resolved``)."""
    return plugins.load_user_plugins(args.plugins)


def _evaluation(args: Any) -> object:
    """What lm-eval inside training and eval.py ask of the evaluation keys (``TaskEvaluation``,
    ``harness.evaluate``/``results_base``, the generator's batch and length), when tasks are set."""
    from megatron.evaluation.harness import results_base
    from megatron.neox_arguments.component_groups import evaluation_run

    if not args.eval_tasks:
        return None
    run = evaluation_run(args)
    return (results_base(run), run.batch_size, run.textgen.maximum_tokens, run.model.seed, run.model.seq_length,
            run.evaluation.eval_tasks_limit, run.evaluation.eval_tasks_interval)


def _generation(args: Any) -> object:
    """What generate.py asks of its keys beyond the checks (``generation.entry.run_generation``, the modes, precompute),
    when text_gen_type is set: the generator, each mode's files and counts, precompute's datasets."""
    from megatron.generation.config import batch_size, token_dataset_prefixes

    if not args.text_gen_type:
        return None
    return (args.sampling(), batch_size(args.train_micro_batch_size_per_gpu), args.seed, args.seq_length, args.num_samples, args.sample_output_file,
            args.sample_input_file, args.prompt_end, args.precompute_model_name, token_dataset_prefixes(args))


def component_builders() -> list[ComponentBuilder]:
    """Everything that turns keys into what a component does, for train.py."""
    return [_run_config, _parallel, _hang_watch, _tokenizer, _model, _checkpoints, _logging, _lora, _lr_schedule,
            _optimizer, _activation_checkpointing, _training_loop, _engine, _step_policies, _data, _objective,
            _evaluation, _generation, _user_plugins,
            deepspeed_config, _launch, run_directory]


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
