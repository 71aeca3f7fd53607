"""Every config error a rank can raise is raised before launch too (issue 42, item 20).

A rank that refuses its config after deepy.py said "dry run OK" wastes a launch (and, on a cluster, a queue
wait): ``configs/tiny.yml configs/local_setup.yml num_gpus=2 model_parallel_size=2 activation=swiglu
norm=rmsnorm`` passed the dry run and then failed on both ranks with "the MLP width = 85 ... not divisible by 2".

:data:`SITES` lists every place the ranks' code raises a config error: each ``raise`` of ``ConfigError`` or a
subclass (``ModelConfigError``, ``BatchError``, ...), each ``required(...)``, and in the model and the tensor-parallel
layers (``megatron/model``, ``megatron/mpu``) each ``ValueError``/``TypeError``/``RuntimeError`` too, since those
stop a rank on a config the layers cannot build. ``test_every_rank_side_config_error_is_listed`` reads the code with
``ast`` and fails when a site is missing from the table (a new error on the ranks needs its twin before launch, or
the reason it cannot have one) or when the table names a site that is gone. Each site says, in source order, how
each of its raises is handled:

* :class:`Before`: the same check runs before launch (a rule, a derivation, the schema or the entry point's own
  check); ``test_the_dry_run_refuses_what_the_ranks_would`` runs ``deepy.py --dry-run``'s checks (``resolve``,
  in-process) on a config that reaches the rank's raise, and wants it refused there, by name;
* :class:`Elsewhere`: the check needs the machine the ranks run on (a GPU, a compiler); the same function runs
  before a launch on this machine, and the ranks check again where they run;
* :class:`RanksOnly`: only the ranks can know (data counted at start-up, the scheduler's environment of each rank);
* :class:`NotFromConfig`: an invariant of Deepy's own code that no config reaches (the reason says why).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatron.config_rules import Device
from megatron.errors import DeepyError

REPO = Path(__file__).resolve().parents[2]

RANK_SIDE = (
    "megatron/model", "megatron/mpu", "megatron/training", "megatron/engine", "megatron/objectives", "megatron/data",
    "megatron/tokenizer", "megatron/initialize.py", "megatron/generation", "megatron/evaluation",
    "megatron/checkpointing", "megatron/logging", "megatron/app/workers.py", "megatron/launcher/environment.py",
    "megatron/neox_arguments/run_config.py", "megatron/neox_arguments/resolved.py", "megatron/plugins.py",
    "megatron/objective_needs.py", "megatron/interop/hf_save_writer.py",
)
"""What the ranks run: train.py, generate.py and eval.py's workers read the resolved config (``run_config``,
``resolved``), join the job (``initialize``, the scheduler's environment) and build the tokenizer, data, model, engine,
objective and checkpoints (model construction, tensor-parallel layers, engine, data, objectives, tokenizer), and
rank 0 the writer of the HF saves (``train.py`` hands it to ``pretrain``)."""

STRICT = ("megatron/model/", "megatron/mpu/")
"""Where a plain ValueError/TypeError/RuntimeError counts as a config error too: the model's and the layers' checks."""
PLAIN = ("ValueError", "TypeError", "RuntimeError")
ALSO: dict[str, tuple[str, ...]] = {"megatron/interop/hf_save_writer.py": ("ConversionError",)}
"""Files where another error type says a config cannot run: the HF writer's "cannot write this run"."""

CPU = Device(cuda=False, fp16_supported=False)


# --- the table -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """``deepy.py --dry-run SCRIPT base.yml OVERRIDES`` (``{name}`` is a file the fixtures make): refused by ``by``
    with a message matching ``says``."""

    by: str
    """The check before launch: ``module.function`` of a rule, derivation or entry-point check, or ``schema``."""
    overrides: str
    says: str
    script: str = "train.py"


@dataclass(frozen=True)
class Before:
    cases: tuple[Case, ...]

    def __init__(self, *cases: Case) -> None:
        object.__setattr__(self, "cases", cases)


@dataclass(frozen=True)
class Elsewhere:
    by: str
    """The rule that runs the same check for a launch on this machine."""
    same: str
    """The function the rule and the ranks both call."""
    why: str


@dataclass(frozen=True)
class RanksOnly:
    why: str


@dataclass(frozen=True)
class NotFromConfig:
    why: str


Entry = Before | Elsewhere | RanksOnly | NotFromConfig

TP2 = "num_gpus=2 model_parallel_size=2"
CP2 = "num_gpus=2 context_parallel_size=2 pipe_parallel_size=0"
FILES = "use_dummy_dataset=false tokenizer_type=HFTokenizer vocab_file={tokenizer}"
DATA = f"{FILES} data_path={{data}}"
PAIRS = "use_dummy_dataset=false tokenizer_type=HFTokenizer vocab_file={tokenizer} train_impl=dpo"
LEVANTER = "lr_decay_style=levanter"
SHAPE = "megatron.model.checks"
CONFIG = "megatron.model.config"
ENTRY = "megatron.neox_arguments.honesty.check_entry_point"
TASKS = "megatron.evaluation.checks.eval_tasks_can_run"
START = "megatron.neox_arguments.file_checks.checkpoint_fits_the_config"
ROPE = "megatron.model.checks.rope_scaling_is_honoured"
SOFT_PROMPT = "megatron.model.option_checks.soft_prompt_runs_where_built"
SCHEDULE = "megatron.engine.lr_config.schedule_builds"
LEVANTER_RULE = "megatron.engine.lr_dialects.levanter_schedule_is_one_levanter_builds"
BATCH = "megatron.neox_arguments.derived.derive_batch"
DATA_CHECKS = "megatron.data.checks"
INTERNAL_TP = ("sizes are checked to split over tensor parallelism before any layer is built "
               "(GPTConfig.check_tensor_parallel, before launch: sizes_split_over_tensor_parallel and the head, "
               "vocabulary and expert rules); what is left is Deepy's own bookkeeping")
RESOLVED = ("the resolved config deepy.py writes after every check always holds it; only a file edited by hand or "
            "left by another Deepy version reaches it")

_TE_HERE = ("Transformer Engine runs only on an NVIDIA GPU: elsewhere te_layernorm_mlp is refused before this rule by "
            "the support check (needs Transformer Engine on an NVIDIA GPU); where it runs, the rule refuses it")
SITES: dict[str, tuple[Entry, ...]] = {
    "megatron/model/transformer_engine.py::te_normalization": (
        Elsewhere("megatron.model.checks", "TE_NORMS", _TE_HERE),
    ),
    "megatron/model/transformer_engine.py::_te_layernorm_mlp": (
        Elsewhere("megatron.model.checks", "TE_MLP_ACTIVATIONS", _TE_HERE),
    ),
    # --- model construction --------------------------------------------------------------------------------
    "megatron/model/attention.py::SelfAttention.__init__": (
        Before(Case("megatron.neox_arguments.rules.context_parallel_fits",
                    f"{CP2} hidden_size=48 num_attention_heads=3", "must both be multiples of 2")),
        Before(Case("megatron.neox_arguments.rules.context_parallel_fits", f"{CP2} pos_emb=rpe",
                    "pos_emb='rpe'.*not supported yet")),
    ),
    "megatron/model/attention.py::SelfAttention.forward": (
        Before(Case(ENTRY, f"{CP2} text_gen_type=unconditional", "generate.py runs whole sequences",
                    script="generate.py"),
               Case(TASKS, f"{CP2} eval_tasks=[{{task_yaml}}]", "eval_tasks=.* with context_parallel_size=2")),
        NotFromConfig("document ids come from the training objectives' packed samples, which never pass a key/value "
                      "cache or an attention mask with them"),
    ),
    "megatron/model/block.py::layer_parameter": (
        Before(Case(f"{CONFIG}.sizes_split_over_tensor_parallel",
                    'num_gpus=4 model_parallel_size=4 pipe_parallel_size=0 attention_config=[[["mamba"],"all"]] '
                    "expansion_factor=1.53125", "splits the Mamba inner width .* = 98 over 4 ranks")),
    ),
    "megatron/model/config.py::GPTConfig._attention_config_shape": (
        Before(Case("schema", 'attention_config=[[["global"],0]]', r"should be \[\[type, \.\.\.\], repeat\]")),
        Before(Case("schema", 'attention_config=[[["bogus"],"all"]]', "unknown attention type")),
    ),
    "megatron/model/config.py::GPTConfig.arch": (
        Before(Case(f"{SHAPE}.model_shape_given", "num_layers=null", "num_layers not set")),
    ),
    "megatron/model/config.py::GPTConfig.vocab": (
        NotFromConfig("every builder sizes the vocabulary for the tokenizer (for_tokenizer) before reading it"),
    ),
    "megatron/model/config.py::GPTConfig.check_architecture": (
        Before(  # the shape rules of model/checks.py and moe_checks.py, run through a ConfigView
            Case(f"{SHAPE}.model_shape_given", "seq_length=null", "seq_length not set"),
            Case(f"{SHAPE}.heads_divide_hidden", "hidden_size=66", "hidden_size=66 .* is not divisible by"),
            Case(f"{SHAPE}.kv_heads_fit", "num_kv_heads=3", "num_kv_heads=3 .* does not divide"),
            Case(ROPE, 'pos_emb=learned rope_scaling={"rope_type":"linear","factor":2.0}', "scales rotary positions"),
            Case("megatron.model.moe_checks.moe_top_k_fits", "moe_num_experts=2 moe_top_k=3", "moe_top_k=3"),
            Case(f"{SHAPE}.mlp_widths_fit", "intermediate_size=128 expansion_factor=2", "both size the MLP"),
            Case(f"{SHAPE}.rotary_dims_even", "rotary_pct=0.1875", "rotary needs an even count"),
            Case(f"{SHAPE}.parallel_residual_keeps_attention", "gpt_j_residual=true use_bias_in_mlp=false",
                 "drops the attention"),
            Case(f"{SHAPE}.positions_fit_the_learned_table", "pos_emb=learned opt_pos_emb_offset=2",
                 "exceeds max_position_embeddings"),
            Case(f"{SHAPE}.fused_gelu_has_a_bias", "bias_gelu_fusion=true use_bias_in_mlp=false", "fused kernel"),
            Case(f"{SHAPE}.rpe_distance_exceeds_half_the_buckets", "pos_emb=rpe rpe_max_distance=8 rpe_num_buckets=32",
                 "rpe_max_distance=8 .* must exceed half of rpe_num_buckets=32"),
            Case(f"{SHAPE}.local_attention_has_a_window", 'attention_config=[[["local"],"all"]]',
                 "needs sliding_window_width"),
        ),
        Before(Case("schema", 'attention_config=[[["sparse_fixed"],"all"]]', "sparse_fixed")),
        Before(Case("megatron.model.family_checks.family_shapes",
                    'attention_config=[[["rwkv"],"all"]] hidden_size=48 num_attention_heads=3', "multiple of 32")),
    ),
    "megatron/model/config.py::GPTConfig._check_choices": (
        Before(Case("schema", "init_method=bogus", "init_method"), Case("schema", "norm=batchnorm", "registered norm")),
    ),
    "megatron/model/config.py::GPTConfig.check_tensor_parallel": (
        Before(  # the issue's split, and each size tensor parallelism splits
            Case(f"{CONFIG}.sizes_split_over_tensor_parallel", f"{TP2} activation=swiglu norm=rmsnorm",
                 r"model_parallel_size=2 .* splits the MLP width .* = 85 over 2 ranks"),
            Case(f"{SHAPE}.heads_divide_over_tp", "num_gpus=4 model_parallel_size=4 num_attention_heads=2",
                 "num_attention_heads=2 .* is not divisible by model_parallel_size=4"),
            Case(f"{SHAPE}.kv_heads_fit", f"{TP2} num_kv_heads=1", "num_kv_heads=1 .* is not divisible by"),
            Case(f"{SHAPE}.vocab_padding_splits_over_tp", f"{TP2} padded_vocab_size=513", "padded_vocab_size=513"),
            Case("megatron.model.moe_checks.moe_experts_split_evenly", f"{TP2} moe_num_experts=3",
                 "moe_num_experts=3 .* is not divisible"),
        ),
    ),
    "megatron/model/config.py::GPTConfig.replace": (NotFromConfig("Deepy's code names a key GPTConfig lacks"),),
    "megatron/model/config.py::expand_attention_config": (
        Before(Case(f"{CONFIG}.attention_config_covers_layers",
                    'attention_config=[[["global","local"],"all"]] num_layers=3 sliding_window_width=4',
                    "do not divide num_layers=3")),
    ),
    "megatron/model/family_config.py::expand_layer_types": (
        Before(Case(f"{CONFIG}.attention_config_covers_layers", 'attention_config=[[["global","global"],"all"]] '
                    "num_layers=3", "do not divide num_layers=3")),
        Before(Case(f"{CONFIG}.attention_config_covers_layers", 'attention_config=[[["global"],3]]',
                    "describes 3 layers but num_layers=2")),
    ),
    "megatron/model/flops.py::flops_per_token": (
        Before(Case(f"{SHAPE}.model_shape_given", "seq_length=null", "seq_length not set")),),
    "megatron/model/flops.py::hardware_flops_per_token": (
        Before(Case(f"{SHAPE}.model_shape_given", "seq_length=null", "seq_length not set")),),
    "megatron/model/gmlp.py::_norm_over_ranks": (
        Before(Case("megatron.model.family_checks.gmlp_norm_splits_over_tensor_parallel",
                    f'{TP2} plugins=[{{toy_norm}}] norm=l1norm attention_config=[[["gmlp"],"all"]]',
                    "norm='l1norm' .* in gMLP layers with model_parallel_size=2")),
    ),
    "megatron/model/gpt.py::GPTModel.forward": (  # generate.py and eval.py build their model without it
        Before(Case(TASKS, f"{TP2} sequence_parallel=true eval_tasks=[{{task_yaml}}]",
                    "eval_tasks=.* with sequence_parallel=True")),
        Before(Case(SOFT_PROMPT, f"{TP2} sequence_parallel=true soft_prompt_tuning={{\"enabled\":true}}",
                    "soft_prompt_tuning=.* with sequence_parallel=True"),
               Case(SOFT_PROMPT, 'soft_prompt_tuning={"enabled":true} reset_attention_mask=true',
                    "soft_prompt_tuning=.* with reset_attention_mask=True")),
    ),
    "megatron/model/pipeline.py::EmbeddingPipe.forward": (
        Before(Case(SOFT_PROMPT, 'pipe_parallel_size=1 soft_prompt_tuning={"enabled":true} reset_attention_mask=true',
                    "soft_prompt_tuning=.* with reset_attention_mask=True")),
    ),
    "megatron/model/lora.py::check_targets": (
        Before(Case("schema", "lora_r=4 lora_target_modules=[]", "lora_target_modules.*at least 1 item"),
               Case("schema", "lora_r=4 lora_target_modules=[bogus]", "lora_target_modules")),
    ),
    "megatron/model/lora.py::adapter_product": (
        NotFromConfig("the sections are the adapted layer's own (its fused q/k/v or gate/up sizes)"),),
    "megatron/model/moe.py::MoELayer.__init__": (
        Before(Case("megatron.model.moe_checks.moe_experts_split_evenly", f"{TP2} moe_num_experts=3",
                    "moe_num_experts=3 .* is not divisible by model_parallel_size=2")),
    ),
    "megatron/model/mup.py::_infshapes": (
        Before(Case("megatron.model.mup_checks.mup_needs_base_shapes", "use_mup=true base_shapes_file=/nonexistent.bsh",
                    "base_shapes_file=.*no such file")),
        RanksOnly("whether the file holds this model's parameter names is known once the ranks build the model "
                  "(torch, which deepy.py does not import)"),
    ),
    "megatron/model/mup.py::apply_base_shapes": (
        Before(Case("megatron.model.mup_checks.mup_init_is_a_normal_init",
                    "use_mup=true base_shapes_file=/nonexistent.bsh init_method=xavier_normal", "normal inits only")),
    ),
    "megatron/model/mup.py::mup_scaled_input": (
        NotFromConfig("build_model applies the base shapes to every model it builds with use_mup, and the rules refuse "
                      "use_mup where Deepy builds one elsewhere (dpo/kto references, reward heads)"),),
    "megatron/model/norms.py::build_norm": (
        Before(Case(f"{SHAPE}.model_shape_given", "hidden_size=null", "hidden_size.* not set")),),
    "megatron/model/option_registry.py::OptionRegistry.register": (
        Before(Case("megatron.plugins.load_user_plugins", "plugins=[{twice_norm}]", "registered twice")),),
    "megatron/model/option_registry.py::OptionRegistry.__getitem__": (
        Before(Case("schema", "norm=batchnorm", "not a registered norm")),),
    "megatron/model/option_registry.py::OptionRegistry.validate": (
        Before(Case("schema", "norm=batchnorm", "not a registered norm")),),
    "megatron/model/pipeline.py::pipeline_location": (
        NotFromConfig("every parameter of the model has a pipeline layer; the names are the model's own"),),
    "megatron/model/positional.py::RotaryEmbedding.__init__": (
        NotFromConfig("max_position_embeddings is derived from seq_length before launch (derive_positions)"),),
    "megatron/model/rope_scaling.py::parse_rope_scaling": (
        Before(Case(ROPE, 'rope_scaling={"rope_type":"linear","factor":2.0,"rope_theta":5.0}',
                    "rope_theta 5.0 differs")),
        Before(Case(ROPE, 'rope_scaling={"factor":2.0}', "names no scaling type")),
        Before(Case(ROPE, 'rope_scaling={"rope_type":"bogus","factor":2.0}', "'bogus' is not supported")),
        Before(Case(ROPE, 'rope_scaling={"rope_type":"linear","factor":2.0,"foo":1}', "does not implement")),
        Before(Case(ROPE, 'rope_scaling={"rope_type":"linear"}', r"needs \['factor'\]")),
        Before(Case(ROPE, 'rope_scaling={"rope_type":"linear","factor":0.5}', "must be >= 1")),
    ),
    # --- the tensor-parallel layers and groups -------------------------------------------------------------
    "megatron/mpu/experts.py::initialize_expert_parallel": (
        Before(Case("megatron.model.moe_checks.moe_experts_split_evenly",
                    "num_gpus=2 pipe_parallel_size=0 moe_num_experts=4 moe_expert_parallel_size=4",
                    "moe_expert_parallel_size=4 .* does not divide the data-parallel size 2")),
    ),
    "megatron/mpu/hybrid_shard.py::shard_and_replica_ranks": (
        Before(Case("megatron.neox_arguments.derived.derive_sharding",
                    "num_gpus=4 pipe_parallel_size=0 sharding_strategy=hsdp sharding_group_size=3",
                    "sharding_group_size=3")),
    ),
    "megatron/mpu/initialize_weights.py::init_method_from_name": (
        Before(Case("schema", "output_layer_init_method=bogus", "output_layer_init_method")),),
    "megatron/mpu/initialize_weights.py::shard_tensor": (
        NotFromConfig("the sections are the layer's own, and add up to its width"),
        NotFromConfig(INTERNAL_TP),
    ),
    "megatron/mpu/initialize_weights.py::initialize_param_": (NotFromConfig(INTERNAL_TP),),
    "megatron/mpu/layers.py::_divide": (
        Before(Case(f"{CONFIG}.sizes_split_over_tensor_parallel", f"{TP2} activation=swiglu",
                    "the MLP width .* = 85 over 2 ranks")),
    ),
    "megatron/mpu/layers.py::ColumnParallelLinear.__init__": (
        NotFromConfig("the model never gathers the output of a fused projection"),),
    "megatron/mpu/layers.py::RowParallelLinear.__init__": (
        NotFromConfig("the model's row-parallel layers all take split inputs"),),
    "megatron/mpu/mappings.py::_split_last": (
        Before(Case(f"{SHAPE}.vocab_padding_splits_over_tp", f"{TP2} padded_vocab_size=513", "padded_vocab_size=513")),
    ),
    "megatron/mpu/mappings.py::_split_first": (
        Before(Case(f"{SHAPE}.sequence_parallel_splits_the_sequence",
                    f"{TP2} sequence_parallel=true seq_length=33", "seq_length=33 .* multiple of 2")),
    ),
    "megatron/mpu/mappings.py::_reduce_scatter_first": (
        Before(Case(f"{SHAPE}.sequence_parallel_splits_the_sequence",
                    f"{TP2} sequence_parallel=true seq_length=33", "seq_length=33 .* multiple of 2")),
    ),
    "megatron/mpu/topology.py::build_topology": (
        Before(Case("megatron.neox_arguments.rules.world_splits_into_model_parallel",
                    "num_gpus=3 model_parallel_size=2", "world size 3 is not divisible")),
    ),
    "megatron/mpu/topology.py::initialize_model_parallel": (
        NotFromConfig("initialize() joins torch.distributed before it builds the groups"),),
    "megatron/mpu/topology.py::get_topology": (NotFromConfig("the groups are built before anything reads them"),),
    # --- engine, optimizer, schedule, objectives -------------------------------------------------------------
    "megatron/engine/compile_checks.py::require_toolchain": (
        Elsewhere("megatron.engine.compile_checks", "toolchain_problems",
                  "torch.compile needs a C++ compiler (and Triton on a GPU) where the ranks run"),
    ),
    "megatron/training/config.py::last_iteration": (
        RanksOnly("max_train_epochs caps the steps at the samples of that many epochs, which the ranks count when "
                  "they build the sample index of the data"),
    ),
    "megatron/engine/build.py::partition_method": (
        Before(Case("megatron.mpu.parallel_config.pipe_partition_method_known", "pipe_partition_method=bogus",
                    "pipe_partition_method='bogus' .* is not known"),
               Case("megatron.mpu.parallel_config.pipe_partition_method_known", "pipe_partition_method=type:(",
                    "does not compile")),
    ),
    "megatron/engine/lr_config.py::LRSchedulerArgs.spec": (
        RanksOnly("only a train_iters below 1 reaches it: the steps of train_epochs, which the ranks count from the "
                  "data (an epoch shorter than one global batch)"),
    ),
    "megatron/engine/lr_dialects.py::frac_or_steps": (
        Before(Case(LEVANTER_RULE, f"{LEVANTER} levanter_warmup=2.5", "neither a fraction")),),
    "megatron/engine/lr_dialects.py::cycle_ends": (
        Before(Case(LEVANTER_RULE, f"{LEVANTER} levanter_cycles=2 levanter_cycle_length=5", "either cycle_length")),
        Before(Case(LEVANTER_RULE, f"{LEVANTER} levanter_cycle_length=[6,6]", "add up to 12 > 10")),
        Before(Case(LEVANTER_RULE, f"{LEVANTER} levanter_cycle_length=0.01", "less than one step")),
    ),
    "megatron/engine/lr_dialects.py::_decay_piece": (
        Before(Case(LEVANTER_RULE, f"{LEVANTER} levanter_warmup=1.0", "needs decay steps > 0")),),
    "megatron/engine/lr_schedules.py::ScheduleSpec.__post_init__": (
        Before(Case("schema", "lr_decay_style=bogus", "registered lr_decay_style")),
        RanksOnly("only a schedule of no steps reaches it: the steps of train_epochs, which the ranks count from the "
                  "data (an epoch shorter than one global batch)"),
        Before(Case("megatron.engine.optimizer_checks.learning_rates_ordered", "min_lr=0.1", "is below min_lr=0.1")),
        Before(Case("schema", "decay_fraction=2", "decay_fraction")),
        NotFromConfig("the timescale is the warmup's steps, at least 1"),
    ),
    "megatron/engine/lr_schedules.py::cycle_starts_for": (
        Before(Case(SCHEDULE, "cycles=2 cycle_length=3", "set only one of cycles and cycle_length")),
        Before(Case("schema", "cycle_length=0", "cycle_length")),
        NotFromConfig("cycle_length is one int (the schema), never a list of lengths"),
        Before(Case(SCHEDULE, "cycles=0", "cycles=0 must be >= 1")),
        Before(Case(SCHEDULE, "cycles=[0,5]", r"every boundary must lie within \(0, 10\)")),
    ),
    "megatron/engine/lr_schedules.py::LRScheduler.load_state_dict": (
        Before(Case(START, "load={other_lr}", "was trained with another LR schedule")),),
    "megatron/objectives/starting_point.py::_committed": (
        Before(Case(START, "train_impl=dpo initialize_from={empty}", "initialize_from=.*")),),
    "megatron/objectives/starting_point.py::starting_point": (
        Before(Case("megatron.objectives.checks.resumed_reference_keeps_its_objective",
                    "train_impl=dpo load={lm_run}", "holds a train_impl='normal' checkpoint")),
    ),
    "megatron/engine/optimizer_config.py::OptimizerArgs.peak_lr": (
        Before(Case("megatron.engine.optimizer_checks", "lr=null", "no learning rate")),),
    "megatron/engine/optimizers.py::build_cpu_adam": (
        RanksOnly("DeepSpeed builds its cpu_adam C++ op (just in time) on the machine of each rank"),),
    "megatron/engine/optimizers.py::build_optimizer": (
        Before(Case("schema", 'optimizer={"type":"Lamb","params":{"lr":0.001}}', "optimizer.type must be one of")),
        Before(Case("megatron.model.lora_checks.lora_targets_are_in_the_model",
                    'lora_r=4 lora_target_modules=[query_key_value] attention_config=[[["mamba"],"all"]] '
                    "pipe_parallel_size=0", "names no projection of this model's layers"),
               Case("megatron.model.lora_checks.lora_targets_are_in_the_model",
                    "lora_r=4 lora_target_modules=[output_layer] no_weight_tying=true num_gpus=2 pipe_parallel_size=2",
                    "only the last pipeline stage holds the head")),
    ),
    "megatron/training/pretrain.py::resolve_train_iters": (
        Before(Case("megatron.training.length_checks", "train_iters=null", "neither train_iters nor train_epochs")),),
    "megatron/training/features/hf.py::build_hf_saves": (NotFromConfig("train.py hands pretrain the HF writer"),),
    "megatron/training/reinit_config.py::token_ids": (
        Before(Case("megatron.training.reinit_config.reinit_tokens_runs", "reinit_tokens=[w1]",
                    "tokenizer_type='CharLevelTokenizer' .* has none")),
        Before(Case("megatron.training.reinit_config.reinit_tokens_runs",
                    "reinit_tokens=[zzz] tokenizer_type=HFTokenizer vocab_file={tokenizer}",
                    "'zzz' not in the tokenizer's vocabulary")),
    ),
    # --- data --------------------------------------------------------------------------------------------------
    "megatron/data/batch.py::solve_batch": (
        Before(Case(BATCH, "train_batch_size=5 gradient_accumulation_steps=2", "train_batch_size=5 .* != ")),
        Before(Case(BATCH, "train_batch_size=5", "train_batch_size=5 .* is not a multiple of")),
        Before(Case(BATCH, "train_micro_batch_size_per_gpu=null train_batch_size=5 gradient_accumulation_steps=2",
                    "is not a multiple of gradient_accumulation_steps")),
        Before(Case(BATCH, "train_micro_batch_size_per_gpu=null train_batch_size=5 num_gpus=2",
                    "not divisible by the data-parallel size 2")),
        Before(Case(BATCH, "train_micro_batch_size_per_gpu=null", "no batch size")),
    ),
    "megatron/data/build.py::parse_split": (
        Before(Case(f"{DATA_CHECKS}.split_is_three_shares", f"{DATA} split=abc", "split='abc' .* must be")),),
    "megatron/data/build.py::_Builder.blend": (
        Before(Case(DATA_CHECKS, f"{FILES} train_data_paths=[{{data}},{{data}}] train_data_weights=[1.0]",
                    "train_data_weights has 1 entries")),
    ),
    "megatron/data/build.py::_components_for_split": (
        Before(Case(f"{DATA_CHECKS}.pairs_and_rewards_match_paths",
                    f"{PAIRS} pos_train_data_paths=[{{data}}] neg_train_data_paths=[{{data}},{{data}}]",
                    "neg_train_data_paths has 2 entries .* pos_train_data_paths has 1")),
        Before(Case(DATA_CHECKS, f"{FILES} train_data_paths=[{{data}}] "
                    "train_label_data_paths=[{data},{data}]", "train_label_data_paths has 2 entries")),
    ),
    "megatron/data/build.py::_check_matches_train_impl": (
        Before(Case("megatron.objectives.checks", f"{DATA} train_impl=dpo", "trains on preference pairs")),
        Before(Case("megatron.objectives.checks", f"{DATA} train_impl=kto", "needs per-document rewards")),
    ),
    "megatron/data/build.py::build_datasets": (
        Before(Case("megatron.neox_arguments.file_checks.dummy_tokens_fit_the_embedding", "dummy_data_vocab_size=1000",
                    "dummy_data_vocab_size=1000 .* exceeds the 512 embedding rows")),
        Before(Case(DATA_CHECKS, "use_dummy_dataset=false", "no training data")),
    ),
    "megatron/tokenizer/build.py::build_tokenizer": (
        Before(Case("schema", "tokenizer_type=Bogus", "registered tokenizer_type")),
        NotFromConfig("the ranks build the tokenizer from the arguments object, which holds every plug-in's keys"),
        Before(Case("megatron.neox_arguments.file_checks.tokenizer_loads", "tokenizer_type=HFTokenizer",
                    "needs vocab_file")),
    ),
    # --- joining the job -----------------------------------------------------------------------------------------
    "megatron/initialize.py::backend_for": (
        Before(Case("megatron.neox_arguments.rules.nccl_needs_a_gpu", "distributed_backend=nccl",
                    "distributed_backend='nccl' .* needs CUDA GPUs")),
    ),
    "megatron/initialize.py::init_distributed": (
        RanksOnly("the GPUs of the node a Slurm task runs on, and what the task's environment lets it see"),),
    "megatron/initialize.py::initialize": (
        NotFromConfig("deepy.py starts exactly the ranks it checked the config for; only a rank started by hand "
                      "reaches it"),
    ),
    "megatron/launcher/environment.py::distributed_env": (
        RanksOnly("the rendezvous address a scheduler (Slurm, MPI) gives each rank it starts"),),
    "megatron/neox_arguments/run_config.py::RunConfig.from_args": (NotFromConfig(RESOLVED),),
    "megatron/neox_arguments/run_config.py::_resolved": (NotFromConfig(RESOLVED),),
    "megatron/neox_arguments/resolved.py::load_resolved": tuple(NotFromConfig(RESOLVED) for _ in range(5)),
    # --- generate.py and eval.py ---------------------------------------------------------------------------------
    "megatron/generation/config.py::TextgenArgs.prompts": (
        Before(Case(ENTRY, "text_gen_type=input-file", "needs sample_input_file", script="generate.py")),),
    "megatron/generation/config.py::checked": (
        Before(Case(ENTRY, "", "generate.py needs text_gen_type", script="generate.py")),
        Before(Case(ENTRY, "text_gen_type=input-file", "needs sample_input_file", script="generate.py")),
        Before(Case(ENTRY, "text_gen_type=input-file sample_input_file={missing}", "no such file",
                    script="generate.py")),
        Before(Case(ENTRY, 'text_gen_type=input-file sample_input_file={prompts} prompt_end=""',
                    "prompt_end must not be empty", script="generate.py")),
        Before(Case(ENTRY, "text_gen_type=input-file sample_input_file={no_prompts}", "holds no prompts",
                    script="generate.py")),
        Before(Case(ENTRY, "text_gen_type=precompute", "needs precompute_model_name", script="generate.py")),
        Before(Case(ENTRY, "text_gen_type=precompute precompute_model_name=ref", "this config has none",
                    script="generate.py")),
        Before(Case(f"{SHAPE}.model_shape_given", "text_gen_type=unconditional seq_length=null", "seq_length not set",
                    script="generate.py")),
    ),
    "megatron/generation/entry.py::build_inference_model": (
        Before(Case(ENTRY, "text_gen_type=unconditional train_impl=rm", "generate.py needs a language model",
                    script="generate.py"),
               Case(TASKS, "eval_tasks=[{task_yaml}] train_impl=rm", "eval_tasks=.* with train_impl='rm'",
                    script="eval.py")),
    ),
    "megatron/evaluation/config.py::checked": (
        Before(Case(ENTRY, "", "eval.py needs eval_tasks", script="eval.py")),
        Before(Case(f"{SHAPE}.model_shape_given", "eval_tasks=[{task_yaml}] seq_length=null", "seq_length not set",
                    script="eval.py")),
    ),
    "megatron/evaluation/harness.py::_task_manager": (  # a name in some task file yet not a task: the ranks' index
        Before(Case(TASKS, "eval_tasks=[no_task_is_called_this]", "unknown task")),),
    "megatron/evaluation/harness.py::_specs": (
        Before(Case(TASKS, "eval_tasks=[{empty}]", "holds no task YAML files")),),
    "megatron/evaluation/harness.py::load_tasks": (
        RanksOnly("a task reads its documents through Hugging Face datasets where the ranks run (network, cache)"),),
    "megatron/evaluation/in_training.py::TaskEvaluation.__init__": (
        Before(Case(TASKS, f"{TP2} sequence_parallel=true eval_tasks=[{{task_yaml}}]",
                    "eval_tasks=.* with sequence_parallel=True")),
    ),
    "megatron/interop/hf_save_writer.py::HFModelWriter.__init__": (
        Before(Case("megatron.neox_arguments.file_checks.hf_saves_can_be_written",
                    "hf_save_path={empty} hf_save_interval=5 pipe_parallel_size=0 pos_emb=alibi",
                    "hf_save_path=.* pos_emb: alibi")),
    ),
    # --- checkpoints, logging, plug-ins ----------------------------------------------------------------------------
    "megatron/checkpointing/manager.py::parse_save_interval": (
        Before(Case("megatron.checkpointing.resume_checks.save_interval_is_duration",
                    "save={empty} save_interval=bogus", "'bogus' is not a duration")),
    ),
    "megatron/checkpointing/manager.py::keep_rules": (
        Before(Case("schema", 'save={empty} keep=[{"every":2,"bogus":1}]', r"should be \{every: N\}")),),
    "megatron/checkpointing/manager.py::CheckpointManager._initialize": (
        Before(Case(START, "finetune=true", "finetune=True .* neither load nor initialize_from")),),
    "megatron/logging/config.py::LoggingArgs.tracker_settings": (
        Before(Case("megatron.logging.preflight", 'tracker=[{"type":"tensorboard"},{"type":"tensorboard"}]',
                    "tensorboard' 2 times")),
        Before(Case("megatron.logging.preflight", 'use_wandb=true tracker=[{"type":"wandb"}]', "configured twice")),
        Before(Case("megatron.logging.preflight", 'tensorboard_dir=a tracker=[{"type":"tensorboard","logdir":"b"}]',
                    "different directories")),
    ),
    "megatron/logging/profiling.py::StepProfiler.__init__": (
        Before(Case("megatron.neox_arguments.rules.memory_snapshot_needs_a_gpu", "memory_profiling=true",
                    "has no GPU")),
    ),
    "megatron/plugins.py::_add": (  # a user's plug-in taking a name Deepy's own table (or another plug-in) has
        Before(Case("megatron.plugins.load_user_plugins", "plugins=[{twice_schedule}]", "registered twice")),),
    "megatron/plugins.py::get": (Before(Case("schema", "lr_decay_style=bogus", "registered lr_decay_style")),),
    "megatron/plugins.py::load_user_plugins": (
        Before(Case("megatron.plugins.load_user_plugins", 'plugins=[""]', "is not a module name")),
        Before(Case("megatron.plugins.load_user_plugins", "plugins=[{missing}.py]", "is not a file")),
        Before(Case("megatron.plugins.load_user_plugins", "plugins=[no_module_is_called_this]", "cannot import")),
    ),
    "megatron/plugins.py::_import_file": (
        NotFromConfig("importlib makes a loader for every .py file"),
        Before(Case("megatron.plugins.load_user_plugins", "plugins=[{broken_plugin}]", "failed to import")),
    ),
}


# --- reading the ranks' code ------------------------------------------------------------------------------------
def _trees() -> dict[str, ast.Module]:
    """Every module of megatron/, parsed once: ``path`` (from the repository root) -> its tree."""
    paths = sorted((REPO / "megatron").rglob("*.py"))
    return {str(path.relative_to(REPO)): ast.parse(path.read_text()) for path in paths}


def _config_errors(trees: dict[str, ast.Module]) -> set[str]:
    """ConfigError and every class of megatron/ derived from it (by name, to a fixed point)."""
    names = {"ConfigError"}
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    while True:
        more = {c.name for c in classes if any(getattr(b, "id", getattr(b, "attr", None)) in names for b in c.bases)}
        if more <= names:
            return names
        names |= more


class _Sites(ast.NodeVisitor):
    def __init__(self, path: str, errors: set[str]) -> None:
        self.path, self.scope = path, []
        self.errors = errors | (set(PLAIN) if path.startswith(STRICT) else set()) | set(ALSO.get(path, ()))
        self.found: dict[str, int] = {}

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def _count(self) -> None:
        key = f"{self.path}::{'.'.join(self.scope) or '<module>'}"
        self.found[key] = self.found.get(key, 0) + 1

    def visit_Raise(self, node: ast.Raise) -> None:
        raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if getattr(raised, "id", getattr(raised, "attr", None)) in self.errors:
            self._count()
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "required":  # megatron.errors.required raises one
            self._count()
        self.generic_visit(node)


def rank_side_sites() -> dict[str, int]:
    """``path::qualified function`` -> how many config errors it raises, for every rank-side module."""
    trees = _trees()
    errors, found = _config_errors(trees), {}
    for path, tree in trees.items():
        if any(path == entry or path.startswith(entry + "/") for entry in RANK_SIDE):
            visitor = _Sites(path, errors)
            visitor.visit(tree)
            found.update(visitor.found)
    return found


def test_every_rank_side_config_error_is_listed() -> None:
    found = rank_side_sites()
    assert found, "the scan found no raise at all"
    problems = [f"{site}: raises {n} config error(s) on the ranks and is not in SITES; add, in source order, how each "
                f"is refused before launch (a rule and a config that reaches it) or why it cannot be"
                for site, n in found.items() if site not in SITES]
    problems += [f"{site}: SITES lists {len(SITES[site])}, the code raises {n}; update the entries" for site, n
                 in found.items() if site in SITES and len(SITES[site]) != n]
    problems += [f"{site}: in SITES but raises nothing now; remove it" for site in SITES if site not in found]
    assert not problems, "\n".join(problems)


def _function(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return importlib.import_module(dotted)  # a module: one of its rules


def test_each_check_named_runs_before_launch() -> None:
    """``by`` names a rule (or a module of rules), a derivation or the entry point's check that deepy.py runs;
    an :class:`Elsewhere` rule calls the very function the ranks call."""
    from megatron.config_rules import RULES
    from megatron.neox_arguments.derived import DERIVATIONS
    from megatron.neox_arguments.honesty import check_entry_point
    from megatron.plugins import load_user_plugins

    before_launch = {*RULES, *DERIVATIONS, check_entry_point, load_user_plugins}
    for site, entries in SITES.items():
        for entry in entries:
            named = [case.by for case in entry.cases] if isinstance(entry, Before) else (
                [entry.by] if isinstance(entry, Elsewhere) else [])
            for by in named:
                if by == "schema":
                    continue
                target = _function(by)
                if inspect.ismodule(target):
                    assert any(rule.__module__ == target.__name__ for rule in RULES), (site, by)
                else:
                    assert target in before_launch, (site, by)
            if isinstance(entry, Elsewhere):
                module = importlib.import_module(entry.by)
                assert any(rule.__module__ == module.__name__ and entry.same in inspect.getsource(rule)
                           for rule in RULES), (site, entry)
                assert entry.same in inspect.getsource(_site_function(site)), site


def _site_function(site: str) -> object:
    path, _, qualname = site.partition("::")
    target: object = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for name in qualname.split("."):
        target = getattr(target, name)
    return target


# --- the dry run on a config that reaches each rank's raise ----------------------------------------------------
BASE = """\
num_gpus: 1
pipe_parallel_size: 1
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
lr: 0.001
train_micro_batch_size_per_gpu: 2
train_iters: 10
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
pos_emb: rotary
"""


def _cases() -> Iterator[tuple[str, Case]]:
    for site, entries in SITES.items():
        for index, entry in enumerate(entries):
            if isinstance(entry, Before):
                for number, case in enumerate(entry.cases):
                    yield f"{site.removeprefix('megatron/')}#{index}.{number}", case


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The base config and what the cases name: a small dataset and its tokenizer, checkpoints, prompts, plug-ins."""
    import numpy as np
    import tokenizers

    from megatron import plugins
    from megatron.checkpointing import commit
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.model.norms import NORMS

    root = tmp_path_factory.mktemp("rank_errors")
    (root / "base.yml").write_text(BASE)
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")).save(str(root / "tokenizer.json"))
    builder = MMapIndexedDatasetBuilder(str(root / "docs.bin"), np.uint16)
    for i in range(20):
        builder.add_item((np.arange(200) + i) % 30)
        builder.end_document()
    builder.finalize(str(root / "docs.idx"))

    def checkpoint(name: str, **args: object) -> str:
        ckpt = root / name / commit.tag_for(5)
        ckpt.mkdir(parents=True)
        recorded = {**yaml.safe_load(BASE), "train_impl": "normal", **args}
        layout = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0, "pipeline": True}
        (ckpt / "deepy_meta.json").write_text(json.dumps({"format": 3, "iteration": 5, "kind": "permanent",
                                                          "layout": layout, "args": recorded}))
        commit.write_commit_marker(ckpt, commit.CommitInfo(step=5, kind="permanent", time=0.0))
        commit.write_latest(root / name, ckpt.name)
        return str(root / name)

    (root / "empty").mkdir()
    (root / "prompts.txt").write_text("Hello\n")
    (root / "no_prompts.txt").write_text("\n  \n")
    (root / "task.yaml").write_text("task: demo\n")
    (root / "twice_norm.py").write_text("from megatron.model.norms import NormEntry, register_norm\n"
                                        "register_norm('rmsnorm', NormEntry(build=lambda dim, c: None, "
                                        "parameters=lambda dim, c: 0))\n")
    (root / "twice_schedule.py").write_text("from megatron import plugins\n"
                                            "plugins.register('lr_decay_style', 'cosine')(lambda p, s, spec: 1.0)\n")
    (root / "broken_plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    names = {"data": str(root / "docs"), "tokenizer": str(root / "tokenizer.json"), "empty": str(root / "empty"),
             "missing": str(root / "missing"), "prompts": str(root / "prompts.txt"),
             "no_prompts": str(root / "no_prompts.txt"), "task_yaml": str(root / "task.yaml"),
             "toy_norm": str(REPO / "tests" / "fixtures" / "toy_norm.py"), "twice_norm": str(root / "twice_norm.py"),
             "twice_schedule": str(root / "twice_schedule.py"), "broken_plugin": str(root / "broken_plugin.py"),
             "lm_run": checkpoint("lm_run"), "other_lr": checkpoint("other_lr", lr=0.01),
             "base": str(root / "base.yml")}
    # each case changes the base by the keys it names only: the base passes, as each script reads it
    dry_run("train.py", names["base"], [])
    dry_run("generate.py", names["base"], ["text_gen_type=unconditional"])
    dry_run("eval.py", names["base"], [f"eval_tasks=[{names['task_yaml']}]"])
    dry_run("train.py", names["base"], ["use_dummy_dataset=false", f"data_path={names['data']}",
                                        "tokenizer_type=HFTokenizer", f"vocab_file={names['tokenizer']}"])
    norms = NORMS.items()
    yield names
    NORMS._entries.clear()  # the toy norm a case loads, forgotten (as test_option_registries.py's fixture does)
    NORMS._owners.clear()
    for name, entry in norms:
        NORMS.register(name, entry, "megatron.model.norms")
    plugins._USER_MODULES.pop(names["toy_norm"], None)


def dry_run(script: str, base: str, overrides: list[str], configs: tuple[str, ...] = ()) -> None:
    """What ``deepy.py --dry-run SCRIPT BASE [CONFIGS] OVERRIDES`` checks, in this process, on a CPU machine."""
    from megatron.app.deepy import DeepyCommand, resolve

    resolve(DeepyCommand(script, [base, *configs], overrides), device=CPU)


@pytest.mark.parametrize("case", [case for _, case in _cases()], ids=[name for name, _ in _cases()])
def test_the_dry_run_refuses_what_the_ranks_would(case: Case, files: dict[str, str]) -> None:
    overrides = [re.sub(r"\{(\w+)\}", lambda m: files.get(m[1], m[0]), token) for token in case.overrides.split()]
    with pytest.raises(DeepyError) as refused:
        dry_run(case.script, files["base"], overrides)
    assert re.search(case.says, refused.value.message, re.DOTALL), refused.value.message


def test_the_issues_tensor_parallel_split_is_refused_before_launch(local_setup_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's command: GPT-NeoX's width rule gives swiglu halves of 85 (int(2 x 4 x 64 / 3) // 2), which two
    tensor-parallel ranks cannot split: the rank's own check (GPTConfig.check_tensor_parallel) refuses the
    config, and now the dry run does, naming model_parallel_size, its value and where it was set."""
    from megatron.model.config import ModelConfigError
    from megatron.neox_arguments.loading import load_config

    monkeypatch.chdir(local_setup_dir)
    command = ["configs/tiny.yml", "configs/local_setup.yml", "num_gpus=2", "model_parallel_size=2",
               "activation=swiglu", "norm=rmsnorm"]
    args = load_config(command[:2], command[2:]).args
    with pytest.raises(ModelConfigError, match="the MLP width .*=85"):  # what each rank raised
        args.for_tokenizer(args.padded(32, 2)).check_tensor_parallel(2)
    with pytest.raises(DeepyError, match=r"model_parallel_size=2 \(command line\) splits the MLP width .* = 85 over "
                                         r"2 ranks.*activation='swiglu' \(command line\)") as refused:
        dry_run("train.py", command[0], command[2:], configs=(command[1],))
    assert "problems in the config" not in refused.value.message  # one problem: this one
