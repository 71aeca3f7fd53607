"""The argument schema: GPT-NeoX's 318 keys with their defaults, Deepy's extras, support marks,
docs, helpers and the shipped configs.

The GPT-NeoX reference (group, name, default of every key) is embedded below so the test runs in
any clone; when the reference TSV from the shared workspace is present, the embedded copy is
checked against it too.
"""

from __future__ import annotations

import ast
import csv
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from megatron.errors import ConfigError
from megatron.neox_arguments.arguments import (
    GROUPS,
    NeoXArgs,
    _owner_map,
    check_supported,
    require_supported,
)
from megatron.neox_arguments.docs import _group_intro
from megatron.model.config import GPTConfig

REPO = Path(__file__).resolve().parents[2]
TSV = REPO.parent / "shared" / "reference" / "gpt-neox-arguments.tsv"

# GPT-NeoX group class -> Deepy group module.
GROUP_MODULE = {
    "NeoXArgsParallelism": "parallelism",
    "NeoXArgsModel": "model",
    "NeoXArgsOptimizer": "optimizer",
    "NeoXArgsLRScheduler": "lr",
    "NeoXArgsLogging": "logging",
    "NeoXArgsOther": "other",
    "NeoXArgsTokenizer": "tokenizer",
    "NeoXArgsTraining": "training",
    "NeoXArgsTextgen": "textgen",
    "NeoXArgsMoE": "moe",
    "NeoXArgsDeepspeedConfig": "deepspeed_config",
    "NeoXArgsDeepspeedRunner": "deepspeed_runner",
}

# GPT-NeoX keys Deepy declares beside the component that reads them rather than in the group mirroring
# GPT-NeoX's (issue 20): key -> the group that declares it. Names and defaults are still GPT-NeoX's.
DECLARED_WITH_COMPONENT: dict[str, str] = {
    **dict.fromkeys(("train_iters", "train_epochs", "eval_iters", "eval_interval", "num_workers", "exit_interval",
                     "char_level_ppl"), "training_loop"),
    **dict.fromkeys(("checkpoint_activations", "checkpoint_num_layers", "deepspeed_activation_checkpointing",
                     "contiguous_checkpointing", "checkpoint_in_cpu", "synchronize_each_layer", "profile_backward",
                     "partition_activations", "activation_checkpointing"), "activation_checkpointing"),
    "weight_decay": "optimizer",
    "optimizer": "optimizer",
    **dict.fromkeys(("vocab_file", "merge_file", "make_vocab_size_divisible_by"), "tokenizer"),
    **dict.fromkeys((
        "save", "config_files", "load", "checkpoint_validation_with_forward_pass", "checkpoint_scale",
        "checkpoint_factor", "extra_save_iters", "no_save_rng", "no_load_optim", "no_load_rng", "finetune",
        "keep_last_n_checkpoints", "iteration", "s3_path", "s3_chunk_size", "no_save_optim",
    ), "checkpoint"),
    **dict.fromkeys(("eval_tasks", "eval_results_prefix"), "evaluation"),
    **dict.fromkeys(("train_impl", "z_loss", "eod_mask_loss", "fp32_reinforce", "kl_impl", "kl_div_beta"), "objective"),
    **dict.fromkeys(("serve_model_weights", "weight_server_port"), "weight_server"),
    **dict.fromkeys(("deepspeed_mpi", "deepspeed_slurm"), "deepspeed_runner"),
    **dict.fromkeys(("curriculum_learning", "curriculum_seqlen", "data_efficiency"), "curriculum"),  # the loop reads them
    **dict.fromkeys(("use_mup", "coord_check", "save_base_shapes", "base_shapes_file", "mup_init_scale", "mup_attn_temp",
                     "mup_output_temp", "mup_embedding_mult", "mup_rp_embedding_mult", "mup_width_scale"), "mup"),
    **dict.fromkeys((
        "data_path", "train_data_paths", "train_label_data_paths", "train_reward_data_paths", "test_data_paths",
        "test_label_data_paths", "test_reward_data_paths", "valid_data_paths", "valid_label_data_paths",
        "valid_reward_data_paths", "pos_train_data_paths", "neg_train_data_paths", "pos_train_label_data_paths",
        "neg_train_label_data_paths", "pos_valid_data_paths", "neg_valid_data_paths", "pos_valid_label_data_paths",
        "neg_valid_label_data_paths", "pos_test_data_paths", "neg_test_data_paths", "pos_test_label_data_paths",
        "neg_test_label_data_paths", "train_data_weights", "valid_data_weights", "test_data_weights",
        "weight_by_num_documents", "weighted_sampler_alpha", "pack_impl", "dataset_impl", "allow_chopped",
        "mmap_warmup", "split", "online_dataserver_ips", "online_dataserver_ports", "reinforce_leave_one_out",
    ), "data"),
    **dict.fromkeys(("attention_dropout", "hidden_dropout", "padded_vocab_size", "seed", "sequence_parallel"), "model"),  # what every layer is built from
}

# Defaults Deepy changes on purpose; each field's docstring says why.
CHANGED_DEFAULTS: dict[str, Any] = {
    "git_hash": None,  # NeoX computes it in the default; Deepy fills it in when resolving
    "distributed_backend": None,  # NeoX's nccl cannot run on CPU; None picks per device
}


def extras() -> set[str]:
    """Deepy's own keys: the schema's fields that are not GPT-NeoX's, derived (a key added to a group is
    one here without any table to update; its doc, default and support come from its declaration)."""
    return set(NeoXArgs.field_names()) - set(NEOX_NAMES)


NEOX_REFERENCE: dict[str, tuple[tuple[str, Any], ...]] = {
    "NeoXArgsParallelism": (
        ("pipe_parallel_size", 0),
        ("model_parallel_size", 1),
        ("pipe_partition_method", "type:transformer|mlp"),
        ("world_size", None),
        ("is_pipe_parallel", False),
        ("sequence_parallel", False),
    ),
    "NeoXArgsModel": (
        ("precision", None),
        ("num_layers", None),
        ("hidden_size", None),
        ("intermediate_size", None),
        ("mlp_multiple_of", 1),
        ("expansion_factor", None),
        ("num_attention_heads", None),
        ("num_kv_heads", None),
        ("seq_length", None),
        ("sliding_window_width", None),
        ("max_position_embeddings", None),
        ("norm", "layernorm"),
        ("layernorm_fusion", False),
        ("rmsnorm_fusion", False),
        ("use_qk_layernorm", False),
        ("layernorm_epsilon", 1e-05),
        ("rms_norm_epsilon", 1e-08),
        ("scalenorm_epsilon", 1e-08),
        ("pos_emb", "learned"),
        ("rpe_num_buckets", 32),
        ("rpe_max_distance", 128),
        ("opt_pos_emb_offset", 0),
        ("no_weight_tying", False),
        ("attention_config", None),
        ("sparsity_config", None),
        ("num_unique_layers", None),
        ("param_sharing_style", "grouped"),
        ("make_vocab_size_divisible_by", 128),
        ("activation", "gelu"),
        ("use_flashattn_swiglu", False),
        ("scaled_upper_triang_masked_softmax_fusion", False),
        ("scaled_masked_softmax_fusion", False),
        ("bias_gelu_fusion", False),
        ("bias_dropout_fusion", False),
        ("rope_fusion", False),
        ("fused_kernels_build_path", None),
        ("fp16_lm_cross_entropy", False),
        ("init_method_std", 0.02),
        ("apply_query_key_layer_scaling", False),
        ("use_cpu_initialization", False),
        ("attention_softmax_in_fp32", False),
        ("rotary_pct", 1.0),
        ("rotary_emb_base", 10000),
        ("rotary_save_freqs_buffer", False),
        ("init_method", "normal"),
        ("output_layer_init_method", "scaled_normal"),
        ("gmlp_attn_dim", 64),
        ("gpt_j_residual", False),
        ("gpt_j_tied", False),
        ("use_bias_in_norms", True),
        ("use_bias_in_attn_linear", True),
        ("use_bias_in_mlp", True),
        ("soft_prompt_tuning", None),
        ("mamba_selective_scan_fusion", False),
        ("mamba_causal_conv_fusion", False),
        ("mamba_inner_func_fusion", False),
        ("mamba_selective_fp32_params", True),
        ("mamba_use_bias_in_conv", True),
        ("mamba_use_bias_in_linears", False),
        ("output_layer_parallelism", "column"),
        ("serve_model_weights", False),
        ("weight_server_port", 6000),
        ("online_dataserver_ips", "localhost"),
        ("online_dataserver_ports", 10000),
        ("te_columnparallel", False),
        ("te_rowparallel", False),
        ("te_layernorm_mlp", False),
        ("te_mha", False),
        ("te_fp8_format", "hybrid"),
        ("te_fp8_wgrad", True),
        ("te_fp8_amax_history_len", 1),
        ("te_fp8_amax_compute_algo", "most_recent"),
        ("te_fp8_margin", 0),
        ("te_fp8_mha", False),
        ("dim_att", None),
        ("head_size", None),
        ("ffn_dim", None),
    ),
    "NeoXArgsOptimizer": (
        ("optimizer_type", "adam"),
        ("use_bnb_optimizer", False),
        ("zero_stage", None),
        ("zero_reduce_scatter", None),
        ("zero_contiguous_gradients", None),
        ("zero_reduce_bucket_size", None),
        ("zero_allgather_bucket_size", None),
        ("lr", None),
    ),
    "NeoXArgsLRScheduler": (
        ("lr_decay_style", "linear"),
        ("lr_decay_iters", None),
        ("lr_decay_fraction", None),
        ("min_lr", 0.0),
        ("warmup", 0.01),
        ("override_lr_scheduler", False),
        ("use_checkpoint_lr_scheduler", False),
    ),
    "NeoXArgsLogging": (
        ("use_wandb", None),
        ("wandb_group", None),
        ("wandb_run_name", None),
        ("wandb_team", None),
        ("wandb_project", "neox"),
        ("wandb_host", "https://api.wandb.ai"),
        ("wandb_init_all_ranks", False),
        ("git_hash", "get_git_commit_hash()"),
        ("log_dir", None),
        ("tensorboard_dir", None),
        ("use_comet", None),
        ("comet_workspace", None),
        ("comet_project", None),
        ("comet_experiment_name", None),
        ("comet_tags", None),
        ("comet_others", None),
        ("comet_experiment", None),
        ("peak_theoretical_tflops", None),
        ("log_interval", 100),
        ("log_grad_pct_zeros", False),
        ("log_param_norm", False),
        ("log_grad_norm", False),
        ("log_optimizer_states", False),
        ("log_gradient_noise_scale", False),
        ("gradient_noise_scale_n_batches", 5),
        ("gradient_noise_scale_cpu_offload", False),
        ("memory_profiling", False),
        ("memory_profiling_path", None),
        ("profile", False),
        ("profile_step_start", 10),
        ("profile_step_stop", 12),
    ),
    "NeoXArgsOther": (
        ("distributed_backend", "nccl"),
        ("local_rank", None),
        ("rank", None),
        ("lazy_mpu_init", False),
        ("short_seq_prob", 0.1),
        ("eod_mask_loss", False),
        ("adlr_autoresume", False),
        ("adlr_autoresume_interval", 1000),
        ("seed", 1234),
        ("onnx_safe", False),
        ("deepscale", False),
        ("deepscale_config", None),
        ("deepspeed_mpi", False),
        ("deepspeed_slurm", False),
        ("user_script", None),
        ("iteration", None),
        ("do_train", None),
        ("do_valid", None),
        ("do_test", None),
        ("global_num_gpus", None),
    ),
    "NeoXArgsTokenizer": (
        ("tokenizer_type", "GPT2BPETokenizer"),
        ("padded_vocab_size", None),
    ),
    "NeoXArgsTraining": (
        ("data_path", None),
        ("use_shared_fs", True),
        ("train_data_paths", None),
        ("train_label_data_paths", None),
        ("train_reward_data_paths", None),
        ("test_data_paths", None),
        ("test_label_data_paths", None),
        ("test_reward_data_paths", None),
        ("valid_data_paths", None),
        ("valid_label_data_paths", None),
        ("valid_reward_data_paths", None),
        ("pos_train_data_paths", None),
        ("neg_train_data_paths", None),
        ("pos_train_label_data_paths", None),
        ("neg_train_label_data_paths", None),
        ("pos_valid_data_paths", None),
        ("neg_valid_data_paths", None),
        ("pos_valid_label_data_paths", None),
        ("neg_valid_label_data_paths", None),
        ("pos_test_data_paths", None),
        ("neg_test_data_paths", None),
        ("pos_test_label_data_paths", None),
        ("neg_test_label_data_paths", None),
        ("train_data_weights", None),
        ("valid_data_weights", None),
        ("test_data_weights", None),
        ("weight_by_num_documents", False),
        ("weighted_sampler_alpha", 1.0),
        ("data_impl", "infer"),
        ("pack_impl", "packed"),
        ("dataset_impl", "gpt2"),
        ("train_impl", "normal"),
        ("dpo_fp32", True),
        ("dpo_reference_free", False),
        ("dpo_beta", 0.1),
        ("kto_fp32", True),
        ("kto_desirable_weight", 1.0),
        ("kto_undesirable_weight", 1.0),
        ("z_loss", 0.0),
        ("kto_beta", 0.1),
        ("fp32_reinforce", True),
        ("kl_impl", "mse"),
        ("kl_div_beta", 0.1),
        ("reinforce_leave_one_out", False),
        ("allow_chopped", True),
        ("mmap_warmup", False),
        ("save", None),
        ("s3_path", None),
        ("s3_chunk_size", 104857600),
        ("config_files", None),
        ("load", None),
        ("checkpoint_validation_with_forward_pass", False),
        ("checkpoint_scale", "linear"),
        ("checkpoint_factor", None),
        ("extra_save_iters", None),
        ("no_save_optim", False),
        ("no_save_rng", False),
        ("no_load_optim", False),
        ("no_load_rng", False),
        ("finetune", False),
        ("batch_size", None),
        ("train_iters", None),
        ("train_epochs", None),
        ("eval_iters", 100),
        ("keep_last_n_checkpoints", None),
        ("eval_interval", 1000),
        ("split", "969, 30, 1"),
        ("vocab_file", None),
        ("merge_file", None),
        ("num_workers", 2),
        ("exit_interval", None),
        ("attention_dropout", 0.0),
        ("hidden_dropout", 0.0),
        ("weight_decay", 0.1),
        ("checkpoint_activations", False),
        ("checkpoint_num_layers", 1),
        ("deepspeed_activation_checkpointing", True),
        ("contiguous_checkpointing", False),
        ("checkpoint_in_cpu", False),
        ("synchronize_each_layer", False),
        ("profile_backward", False),
        ("partition_activations", False),
        ("clip_grad", 1.0),
        ("hysteresis", 2),
        ("dynamic_loss_scale", None),
        ("loss_scale", None),
        ("loss_scale_window", 1000.0),
        ("min_scale", 1.0),
        ("char_level_ppl", False),
        ("use_mup", False),
        ("coord_check", False),
        ("save_base_shapes", False),
        ("base_shapes_file", None),
        ("mup_init_scale", 1.0),
        ("mup_attn_temp", 1.0),
        ("mup_output_temp", 1.0),
        ("mup_embedding_mult", 1.0),
        ("mup_rp_embedding_mult", 1.0),
        ("mup_width_scale", 2),
    ),
    "NeoXArgsTextgen": (
        ("text_gen_type", None),
        ("precompute_model_name", None),
        ("temperature", 0.0),
        ("top_p", 0.0),
        ("top_k", 0),
        ("return_logits", False),
        ("maximum_tokens", 64),
        ("prompt_end", "\n"),
        ("sample_input_file", None),
        ("sample_output_file", "samples.txt"),
        ("num_samples", 1),
        ("recompute", False),
        ("eval_results_prefix", ""),
        ("eval_tasks", None),
    ),
    "NeoXArgsMoE": (
        ("moe_num_experts", 1),
        ("moe_expert_interval", 1),
        ("moe_top_k", 1),
        ("moe_router_type", "sinkhorn"),
        ("moe_lbl_in_fp32", False),
        ("moe_jitter_eps", None),
    ),
    "NeoXArgsDeepspeedConfig": (
        ("deepspeed", True),
        ("train_batch_size", None),
        ("train_micro_batch_size_per_gpu", None),
        ("gradient_accumulation_steps", 1),
        ("optimizer", None),
        ("scheduler", None),
        ("fp32_allreduce", False),
        ("prescale_gradients", False),
        ("gradient_predivide_factor", 1.0),
        ("sparse_gradients", False),
        ("fp16", None),
        ("bf16", None),
        ("amp", None),
        ("gradient_clipping", 1.0),
        ("zero_optimization", None),
        ("curriculum_learning", None),
        ("curriculum_seqlen", 0),
        ("steps_per_print", 10),
        ("wall_clock_breakdown", False),
        ("dump_state", False),
        ("flops_profiler", None),
        ("communication_data_type", None),
        ("autotuning", None),
        ("activation_checkpointing", None),
        ("sparse_attention", None),
        ("data_efficiency", None),
        ("tensorboard", None),
        ("wandb", None),
        ("csv_monitor", None),
        ("elasticity", None),
        ("comms_logger", None),
        ("compression_training", None),
        ("checkpoint", None),
        ("data_types", None),
        ("deepspeed_extra_args", None),
    ),
    "NeoXArgsDeepspeedRunner": (
        ("hostfile", None),
        ("include", None),
        ("exclude", None),
        ("num_nodes", -1),
        ("num_gpus", None),
        ("master_port", 29500),
        ("master_addr", None),
        ("launcher", "pdsh"),
        ("force_multi", False),
        ("autotuning_run", None),
        ("no_ssh_check", False),
        ("comment", None),
        ("account", None),
    ),
}

NEOX_NAMES: list[str] = [name for fields in NEOX_REFERENCE.values() for name, _ in fields]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b and type(a) is type(b)


# ---------------------------------------------------------------- the GPT-NeoX reference


def test_reference_has_318_unique_names() -> None:
    assert len(NEOX_NAMES) == 318
    assert len(set(NEOX_NAMES)) == 318


def test_embedded_reference_matches_tsv_when_present() -> None:
    """The embedded copy is what the other tests trust; check it against the source if we can."""
    if not TSV.exists():
        # Users' clones have no shared workspace: the embedded list is then the reference, and
        # the least we can check is that it is well formed (12 groups, named like NeoX's).
        assert set(NEOX_REFERENCE) == set(GROUP_MODULE)
        return
    with TSV.open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    assert [r["name"] for r in rows] == NEOX_NAMES
    embedded = {name: (group, default) for group, fs in NEOX_REFERENCE.items() for name, default in fs}
    for row in rows:
        group, default = embedded[row["name"]]
        assert group == row["group"]
        if row["default"] == "get_git_commit_hash()":
            continue
        assert _same(ast.literal_eval(row["default"]), default), row["name"]


def test_every_neox_key_is_a_field_in_its_group() -> None:
    """In the group mirroring GPT-NeoX's, beside the component that reads it (BESIDE_COMPONENT), or with
    the plug-in that reads it (``train_impl:dpo``)."""
    for neox_group, fields in NEOX_REFERENCE.items():
        for name, _ in fields:
            assert NeoXArgs.has_field(name), name
            owner = NeoXArgs.group_of(name)
            assert owner == DECLARED_WITH_COMPONENT.get(name, GROUP_MODULE[neox_group]) or ":" in owner, name
            assert name in NeoXArgs.groups()[owner].model_fields


@pytest.mark.parametrize("neox_group", sorted(NEOX_REFERENCE))
def test_defaults_match_neox(neox_group: str) -> None:
    for name, neox_default in NEOX_REFERENCE[neox_group]:
        expected = CHANGED_DEFAULTS.get(name, neox_default)
        actual = NeoXArgs.default_of(name)
        assert _same(actual, expected), f"{name}: {actual!r} != {expected!r}"


def test_changed_defaults_explain_themselves() -> None:
    for name in CHANGED_DEFAULTS:
        doc = NeoXArgs.doc_of(name)
        assert "GPT-NeoX" in doc and "default" in doc, name


def test_field_count_is_neox_plus_extras_and_nothing_else() -> None:
    names = set(NeoXArgs.field_names())
    assert len(NeoXArgs.field_names()) == len(names) == 318 + len(extras())
    assert set(NEOX_NAMES) <= names  # every GPT-NeoX key, once
    assert set(NeoXArgs.model_fields) == names


def test_a_group_declaring_keys_gpt_neox_files_elsewhere_says_where() -> None:
    """The generated docs' intro of such a group (``configs/neox_arguments.md``) names GPT-NeoX's group
    of each key it took, as the docs' header promises."""
    neox_group_of = {name: group for group, fields in NEOX_REFERENCE.items() for name, _ in fields}
    for name, group in DECLARED_WITH_COMPONENT.items():
        assert NeoXArgs.group_of(name) == group, name
        assert neox_group_of[name] in _group_intro(group, NeoXArgs.groups()[group]), name


def test_two_groups_declaring_one_key_is_caught() -> None:
    with pytest.raises(TypeError, match="precision.*model and again"):
        _owner_map({"model": GPTConfig, "again": GPTConfig})


# ---------------------------------------------------------------- Deepy extras


def test_extras_are_supported_and_belong_to_a_group() -> None:
    """A key Deepy adds is built (GPT-NeoX's own keys may be accepted only at their default) and declared in a
    component's group; its default is held by ``test_resolved_unchanged.py``'s snapshot of the defaults."""
    assert len(extras()) >= 90
    for name in sorted(extras()):
        assert NeoXArgs.is_supported(name), name
        assert NeoXArgs.group_of(name) in NeoXArgs.groups(), name


def test_extras_accept_their_documented_forms() -> None:
    args = NeoXArgs(
        lr_decay_style="wsd",
        decay_fraction=0.2,
        cycles=[1000, 5000],
        rewarmup=0.05,
        min_lr_ratio=0.1,
        save_interval="15min",
        keep=[{"every": 1000, "until": 10000}, {"every": 5000}],
        train_urls=["data/a.jsonl.zst"],
        selective_checkpointing=2,
        per_device_parallelism=8,
        launcher="mpich",
    )
    assert args.lr_decay_style == "wsd"
    assert args.cycles == [1000, 5000]
    assert args.keep == [{"every": 1000, "until": 10000}, {"every": 5000}]
    assert args.save_interval == "15min"
    assert args.launcher == "mpich"
    assert NeoXArgs(cycles=4, save_interval=900).cycles == 4
    for style in ("inv_sqrt", "inv", "constant", "linear", "cosine", "exponential"):
        assert NeoXArgs(lr_decay_style=style).lr_decay_style == style


@pytest.mark.parametrize(
    "bad",
    [
        {"lr_decay_style": "step"},
        {"launcher": "ssh"},
        {"decay_fraction": 1.5},
        {"max_consecutive_overflows": 0},
        {"keep": [{"every": "often"}]},
        {"keep": [{"evry": 1000}]},
        {"keep": [{"every": 0}]},
        {"hidden_size": 0},
        {"num_layers": -1},
        {"hidden_dropout": 1.0},
        {"rotary_pct": 0.0},
        {"pos_emb": "xpos"},
        {"master_port": 70000},
        {"attention_config": [["global", 12]]},
        {"attention_config": [[["nonsense"], 2]]},
        {"not_a_key": 1},
    ],
)
def test_bad_values_fail_validation(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        NeoXArgs(**bad)
    assert next(iter(bad)) in str(info.value)


def test_runtime_values_can_be_assigned() -> None:
    args = NeoXArgs(hidden_size=64)
    args.padded_vocab_size = 50304
    args.iteration = 7
    assert (args.padded_vocab_size, args.iteration, args.hidden_size) == (50304, 7, 64)


# ---------------------------------------------------------------- docs and helpers


def test_every_field_has_a_real_doc() -> None:
    docs = {}
    for name in NeoXArgs.field_names():
        doc = NeoXArgs.doc_of(name)
        assert len(doc) >= 15 and doc.endswith("."), f"{name}: {doc!r}"
        assert "\n" not in doc
        docs[name] = doc
    # docs are written per field, not pasted: few share their text
    assert len(set(docs.values())) >= len(docs) - 5


def test_group_docs_and_helpers() -> None:
    assert NeoXArgs.group_of("hidden_size") == "model"
    assert NeoXArgs.group_of("train_micro_batch_size_per_gpu") == "deepspeed_config"
    assert NeoXArgs.group_of("hostfile") == "deepspeed_runner"
    assert "rotary" in NeoXArgs.doc_of("rotary_pct")
    assert NeoXArgs.default_of("norm") == "layernorm"
    with pytest.raises(ConfigError, match="hidden_size"):
        NeoXArgs.group_of("hiden_size")
    assert NeoXArgs.suggest("num-layer")[0] == "num_layers"
    for name, group in NeoXArgs.groups().items():
        # a group mirroring one of GPT-NeoX's names it; Deepy's own groups say what they hold
        assert group.__doc__ and ("NeoXArgs" in group.__doc__ or name in ("plugins",) or ":" in name), name


# ---------------------------------------------------------------- support marks

MUST_BE_SUPPORTED = [
    "pipe_parallel_size", "model_parallel_size", "sequence_parallel", "hidden_size", "num_kv_heads",
    "pos_emb", "rpe_num_buckets", "attention_config", "activation", "precision", "optimizer_type",
    "lr", "zero_stage", "lr_decay_style", "warmup", "data_path", "train_data_paths", "save", "load",
    "checkpoint_factor", "keep_last_n_checkpoints", "s3_path", "s3_chunk_size", "extra_save_iters", "finetune", "no_load_optim",
    "no_load_rng", "log_dir", "log_interval", "train_batch_size", "zero_optimization", "fp16", "bf16",
    "optimizer", "hostfile", "num_gpus", "launcher", "deepspeed_slurm", "train_impl",
    "scaled_upper_triang_masked_softmax_fusion", "mmap_warmup", "override_lr_scheduler",
    "checkpoint_validation_with_forward_pass", "hysteresis", "peak_theoretical_tflops",
    # built by the logging component (megatron/logging/; tests/e2e/test_observability.py)
    "tensorboard_dir", "use_wandb", "wandb_project", "wandb_group", "wandb_run_name", "wandb_team",
    "wandb_host", "wandb_init_all_ranks", "tracker", "log_param_norm", "log_grad_norm", "log_grad_pct_zeros",
    "log_optimizer_states", "profile", "profile_step_start", "profile_step_stop", "memory_profiling",
    "memory_profiling_path", "wall_clock_breakdown", "deepspeed_log_level", "device_memory_gb",
    # Comet, the gradient noise scale, character-level perplexity (test_comet_tracker.py,
    # test_gradient_noise_scale.py, test_char_level_ppl.py)
    "use_comet", "comet_workspace", "comet_project", "comet_experiment_name", "comet_tags", "comet_others",
    "log_gradient_noise_scale", "gradient_noise_scale_n_batches", "gradient_noise_scale_cpu_offload", "char_level_ppl",
    # post-training (tests/unit/test_objectives.py, tests/e2e/test_post_training.py show each changes the run)
    "dpo_beta", "dpo_fp32", "dpo_reference_free", "kto_beta", "kto_fp32", "kto_desirable_weight",
    "kto_undesirable_weight", "z_loss", "eod_mask_loss", "reference_logps", "pos_train_data_paths",
    "neg_valid_label_data_paths", "train_label_data_paths", "train_reward_data_paths", "dataset_impl", "pack_impl",
    # the sequence curriculum and optimizer-less saves (tests/unit/test_neox_deepspeed_keys.py)
    "curriculum_learning", "data_efficiency", "no_save_optim", "deepspeed_activation_checkpointing",
]  # fmt: skip
MUST_BE_UNSUPPORTED = [
    "sparsity_config",
    "sparse_attention", "scheduler",
    "sparse_gradients",
]  # fmt: skip


def test_support_marks_follow_the_scope() -> None:
    for name in MUST_BE_SUPPORTED:
        assert NeoXArgs.is_supported(name), name
    for name in MUST_BE_UNSUPPORTED:
        assert not NeoXArgs.is_supported(name), name
    assert all(NeoXArgs.is_supported(n) for n in NeoXArgs.field_names() if n.startswith("moe_"))
    # Transformer Engine's keys are built where it and a GPU are (tests/unit/test_gpu_libraries.py)
    assert all(NeoXArgs.gpu_library(n) for n in NeoXArgs.field_names() if n.startswith("te_"))
    # Mamba layers are built (tests/unit/test_model_families.py), A_log/D in fp32 or not (test_model_options.py)
    mamba = {n for n in NeoXArgs.field_names() if n.startswith("mamba_")}
    assert {n for n in mamba if not NeoXArgs.is_supported(n)} == set()


def test_check_supported_reports_only_offending_keys() -> None:
    config = {
        "hidden_size": 64,
        "moe_num_experts": 8,  # MoE is built
        "te-mha": True,  # hyphenated spelling still counts
        "norm": "te_rmsnorm",  # supported field, a value that needs Transformer Engine on a GPU
        "train_impl": "normal",  # supported value
        "attention_config": [[["global", "bigbird"], 2]],
        "unknown_key": 3,  # not this check's business
    }
    no_gpu = lambda library: "this machine has no GPU"  # noqa: E731
    assert check_supported(config, no_gpu) == ["te_mha", "norm", "attention_config"]
    assert check_supported(config, lambda library: None) == ["attention_config"]  # where the library runs
    assert check_supported({"attention_config": [[["global", "local"], 4]], "norm": "rmsnorm"}) == []
    assert check_supported({"train_impl": "reinforce", "data_impl": "cached"}) == ["data_impl"]  # reinforce is built


def test_check_supported_on_validated_args(key_not_supported_yet: str) -> None:
    assert check_supported(NeoXArgs(hidden_size=64)) == []
    assert check_supported(NeoXArgs(use_mup=True, dataset_impl="online")) == ["use_mup"]  # online is built


def test_require_supported_names_every_key_and_the_fix(key_not_supported_yet: str) -> None:
    require_supported({"hidden_size": 8})
    with pytest.raises(ConfigError) as info:
        require_supported({"use_mup": True, "norm": "te_layernorm"}, lambda library: "this machine has no GPU")
    message = str(info.value)
    assert "use_mup: True is not supported yet" in message
    assert "only its default False is accepted" in message
    assert "norm: 'te_layernorm' needs Transformer Engine (pip package transformer-engine" in message
    assert "on an NVIDIA GPU; this machine has no GPU" in message


# ---------------------------------------------------------------- shipped configs

CONFIGS = sorted((REPO / "configs").rglob("*.yml"))
DATA_KEYS = {"data_path", "vocab_file", "merge_file", "tokenizer_type", "save", "load", "log_dir"}


def _load(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        data = yaml.safe_load(handle)
    assert isinstance(data, dict), path
    return {key.replace("-", "_"): value for key, value in data.items()}


def test_all_required_configs_are_shipped() -> None:
    names = {str(p.relative_to(REPO / "configs")) for p in CONFIGS}
    required = {f"{s}.yml" for s in "19M 49M 125M 350M 760M 1-3B 2-7B 6-7B 13B 20B".split()}
    required |= {f"pythia/{s}.yml" for s in "14M 31M 70M 160M 410M 1-4B 2-8B 6-9B 12B".split()}
    required |= {"llama/7B.yml", "llama2/7B.yml", "mistral/7B.yml", "local_setup.yml", "tiny.yml"}
    assert required <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_shipped_config_is_valid_and_supported(path: Path) -> None:
    config = _load(path)
    unknown = [key for key in config if not NeoXArgs.has_field(key)]
    assert unknown == []
    NeoXArgs(**config)
    assert check_supported(config) == []
    # optimizer hyperparameters must be real floats (PyYAML reads `1e-8` as a string)
    for value in config.get("optimizer", {}).get("params", {}).values():
        assert not isinstance(value, str)


def test_model_configs_merge_with_local_setup() -> None:
    local = _load(REPO / "configs" / "local_setup.yml")
    assert DATA_KEYS - {"merge_file"} <= set(local)
    assert local["data_path"] == "data/pydocs/pydocs_text_document"
    for path in CONFIGS:
        if path.name == "local_setup.yml":
            continue
        config = _load(path)
        assert set(config) & set(local) == set(), path
        assert not DATA_KEYS & set(config), path
        merged = NeoXArgs(**config, **local)
        assert merged.num_layers is not None and merged.hidden_size is not None


def test_architecture_numbers() -> None:
    c = REPO / "configs"
    pythia = NeoXArgs(**_load(c / "pythia" / "12B.yml"))
    assert (pythia.num_layers, pythia.hidden_size, pythia.num_attention_heads) == (36, 5120, 40)
    assert pythia.rotary_pct == 0.25 and pythia.gpt_j_residual and pythia.no_weight_tying
    neox20 = NeoXArgs(**_load(c / "20B.yml"))
    assert (neox20.num_layers, neox20.hidden_size, neox20.num_attention_heads) == (44, 6144, 64)
    llama = NeoXArgs(**_load(c / "llama2" / "7B.yml"))
    assert llama.norm == "rmsnorm" and llama.activation == "swiglu" and llama.ffn_hidden_size == 11008
    assert not (llama.use_bias_in_mlp or llama.use_bias_in_attn_linear or llama.use_bias_in_norms)
    assert llama.seq_length == 4096 and llama.no_weight_tying
    mistral = NeoXArgs(**_load(c / "mistral" / "7B.yml"))
    assert (mistral.num_kv_heads, mistral.sliding_window_width, mistral.ffn_hidden_size) == (8, 4096, 14336)
    tiny = NeoXArgs(**_load(c / "tiny.yml"))
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.seq_length) == (2, 64, 4, 128)
    assert tiny.precision == "fp32" and tiny.train_iters == 200 and tiny.num_gpus == 2
    assert tiny.hidden_dropout == 0.0 and tiny.checkpoint_factor == 100
