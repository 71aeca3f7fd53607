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
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from megatron.neox_arguments import config_from_mapping
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import finalize
from megatron.neox_arguments.honesty import FILLED_IN_KEYS, NO_EFFECT_KEYS, only_default_accepted
from megatron.config_rules import Device

from effect_index import DEEPSPEED_STATE_TESTS, TestSource, effect_tests, naming_tests
from key_reads import ReadRecorder, keys_read

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
        f"these keys are accepted but no component reads them: {unread}. Read each in the component "
        f"that declares it, or mark it not_supported in the schema, or (kernel hints only) list it in "
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




def _type_checking_names(module_name: str) -> dict[str, Any]:
    """The names a module imports only for type checkers (``if TYPE_CHECKING:``), imported here so its
    annotations resolve: the model's config keeps torch out of loading a config that way."""
    import ast
    import importlib
    import sys

    names: dict[str, Any] = {}
    for node in ast.parse(inspect.getsource(sys.modules[module_name])).body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"):
            continue
        for imp in node.body:
            if isinstance(imp, ast.Import):
                names.update({a.asname or a.name.split(".")[0]:
                              importlib.import_module(a.name if a.asname else a.name.split(".")[0]) for a in imp.names})
            elif isinstance(imp, ast.ImportFrom) and imp.module:
                module = importlib.import_module("." * imp.level + imp.module, sys.modules[module_name].__package__)
                names.update({a.asname or a.name: getattr(module, a.name) for a in imp.names})
    return names


def _derived_hints(group: type) -> list[Any]:
    """Return types of the methods and properties an argument group defines itself (the settings it
    derives from its keys, e.g. ``LoggingArgs.tracker_settings``)."""
    import typing

    hints: list[Any] = []
    for attr in vars(group).values():
        fn = attr.fget if isinstance(attr, property) else attr
        if inspect.isfunction(fn) and not fn.__name__.startswith("_"):
            hints.append(typing.get_type_hints(fn, localns=_type_checking_names(fn.__module__)).get("return"))
    return hints


def component_config_classes() -> list[type]:
    """Every typed config a component receives: RunConfig's views, the entry points', and the dataclasses
    nested in them or derived by the argument groups RunConfig hands over whole (the logging keys'
    tracker settings, ...). None is skipped."""
    import typing

    from megatron.config_schema import ArgGroup
    from megatron.generation.config import TextgenArgs
    from megatron.neox_arguments.run_config import RunConfig

    found: list[type] = []
    todo: list[type] = [RunConfig, TextgenArgs]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        is_group = issubclass(cls, ArgGroup)
        # a group's settings are what its methods derive; a dataclass (RunConfig's parts too) holds them as fields
        hints = _derived_hints(cls) if is_group else list(typing.get_type_hints(cls).values())
        for hint in hints:
            stack = [hint]
            while stack:
                tp = stack.pop()
                if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or issubclass(tp, ArgGroup)):
                    todo.append(tp)
                stack.extend(typing.get_args(tp))
    # RunConfig only bundles the others; a group's keys are checked by the honesty index, not here
    return [cls for cls in found if dataclasses.is_dataclass(cls) and cls is not RunConfig]


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
    assert {"WandbSettings", "ProfileSettings", "SamplingParams"} <= names, names
    reads = attribute_reads()
    unused = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls) if f.name not in reads]
    assert unused == [], f"typed config fields nothing reads outside their from_args: {unused}"


# ------------------------------------------------------------------- dialects (Levanter, fms-fsdp)
# every dialect key Deepy accepts, with a value it may take: each must become GPT-NeoX keys that a
# component reads (so the dialect key is honoured), or be refused by name (tests/unit/test_dialects.py)
DIALECT_SAMPLES: dict[str, dict[str, object]] = {
    "levanter": {
        "model.type": "gpt2", "model.hidden_dim": 64, "model.intermediate_dim": 128, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.num_layers": 2, "model.seq_len": 32, "model.gradient_checkpointing": True,
        "model.scale_attn_by_inverse_layer_idx": True, "model.initializer_range": 0.02, "model.resid_pdrop": 0.1,
        "model.attn_pdrop": 0.1, "model.embed_pdrop": 0.0, "model.layer_norm_epsilon": 1e-5,
        "model.activation_function": "gelu_new", "model.use_bias": False, "model.use_layer_norm_weight": False,
        "model.tie_word_embeddings": False, "model.rope": {"type": "default", "theta": 500000},
        "model.rope.type": "default", "model.rope.theta": 500000, "model.sliding_window": 16, "model.upcast_attn": True,
        "trainer.seed": 3, "trainer.num_train_steps": 10, "trainer.train_batch_size": 8,
        "trainer.per_device_parallelism": 2, "trainer.per_device_train_parallelism": 2,
        "trainer.per_device_eval_parallelism": -1, "trainer.steps_per_eval": 5, "trainer.max_eval_batches": 2,
        "trainer.mp": "p=f32,c=bfloat16", "trainer.model_axis_size": 2, "trainer.id": "run1", "trainer.log_dir": "logs",
        "trainer.load_checkpoint": False, "trainer.load_checkpoint_path": "ck", "trainer.initialize_from": "ck",
        "trainer.checkpointer.base_path": "out", "trainer.checkpointer.append_run_id_to_base_path": False,
        "trainer.checkpointer.save_interval": "15min", "trainer.checkpointer.keep": [{"every": 10}],
        "trainer.profiler": True, "trainer.profiler_start_step": 2, "trainer.profiler_num_steps": 3,
        "trainer.tracker": [{"type": "wandb", "project": "p"}], "trainer.wandb": {"project": "p"},
        "trainer.wandb.resume": True, "trainer.tracker.resume": True,
        **{f"trainer.{p}.{f}": v for p in ("wandb", "tracker") for f, v in (
            ("project", "p"), ("entity", "e"), ("name", "n"), ("group", "g"), ("tags", ["t"]), ("notes", "x"),
            ("mode", "offline"), ("id", "run1"))},
        "trainer.tracker.type": "tensorboard", "trainer.tracker.logdir": "tb",
        "optimizer.type": "adam", "optimizer.learning_rate": 1e-3, "optimizer.weight_decay": 0.1,
        "optimizer.beta1": 0.8, "optimizer.beta2": 0.95, "optimizer.epsilon": 1e-6, "optimizer.max_grad_norm": 0.5,
        "optimizer.min_lr_ratio": 0.1, "optimizer.warmup": 0.1, "optimizer.decay": 0.5,
        "optimizer.lr_schedule": "linear", "optimizer.cycles": 2, "optimizer.rewarmup": 0.1,
        "data.train_urls": ["a.jsonl"], "data.validation_urls": ["b.jsonl"], "data.cache_dir": "c",
        "data.tokenizer": str(REPO / "README.md"),
        # keys accepted at values that are what Deepy does, keys of the levanter schedule, TrainLmConfig's own
        "model.mlp_scale": 4, "model.rope.factor": 2.0, "model.rope.low_freq_factor": 1.0,
        "model.rope.high_freq_factor": 4.0, "model.rope.original_max_position_embeddings": 8192,
        "model.rope.beta_fast": 32.0, "model.rope.beta_slow": 1.0, "model.rope.mscale": 1.0,
        "model.attn_backend": "jax_flash", "model.use_flash_attention": True, "model.flash_attention_block_size": 512,
        "model.cross_entropy_block_size": 1024, "model.scan_layers": True, "model.reference_checkpoint": "x",
        "model.tokenizer": "x", "model.head_dim": None, "model.hybrid_norm": False, "model.input_embedding_norm": False,
        "model.query_pre_attn_scalar": 256.0, "model.attn_logit_softcapping": 50.0,
        "model.final_logit_softcapping": 30.0, "model.use_qk_norm": True, "model.sliding_window_pattern": 6,
        "model.rope_local_base_freq": 10000.0,
        "model.attention_bias": True,
        "model.use_sliding_window": False, "model.max_window_layers": 0,
        "trainer.allow_nondivisible_batch_size": False, "trainer.quantization": None, "trainer.model_averaging": None,
        "trainer.replica_ici_axis_size": 1, "trainer.replica_dcn_axis_size": 1, "trainer.batch_axis": "batch",
        "trainer.fsdp_axis": "embed", "trainer.tensor_parallel_axes": ["mlp", "heads"],
        "trainer.axis_resources": {"embed": "data"}, "trainer.parameter_axis_resources": {"embed": "data"},
        "trainer.allow_partial_checkpoint": False, "trainer.checkpointer.delete_old_temp_checkpoints": True,
        "trainer.profiler_perfetto_link": False, "trainer.log_jaxprs": True, "trainer.log_xla_hlo": True,
        "trainer.jax_config": {}, "trainer.jax_compilation_cache_dir": None, "trainer.ray": {"address": "auto"},
        "trainer.require_accelerator": False, "trainer.shutdown_at_exit": False,
        "trainer.wandb.save_code": False, "trainer.tracker.save_code": False, "trainer.wandb.save_xla_dumps": False,
        "trainer.tracker.save_xla_dumps": False, "trainer.tracker.comment": "", "trainer.tracker.purge_step": None,
        "trainer.tracker.max_queue": 10, "trainer.tracker.flush_secs": 120, "trainer.tracker.filename_suffix": "",
        "trainer.tracker.write_to_disk": True,
        "optimizer.cooldown": 0.1, "optimizer.cycle_length": 10, "optimizer.haps": [5],
        "optimizer.weight_decay_modules": None, "optimizer.default_weight_decay_mask": None, "optimizer.nesterov": False,
        "optimizer.update_rms_clipping": None, "optimizer.clip_update_norm": None, "optimizer.skip_bad_steps": False,
        "optimizer.adamc_weight_decay": False, "optimizer.eps": 1e-20, "optimizer.schedule_list": None,
        "optimizer.gamma": 0.01, "optimizer.clip_threshold": 1.0, "optimizer.update_interval": 10,
        "optimizer.rng_seed": 0, "optimizer.shampoo_beta": 0.95, "optimizer.precondition_frequency": 10,
        "optimizer.max_precond_dim": 10000, "optimizer.merge_small_dims": True, "optimizer.target_merged_dim_size": 2048,
        "optimizer.one_diag": False, "optimizer.partition_grads_into_blocks": True, "optimizer.block_size": 256,
        "optimizer.mu_dtype": None, "optimizer.precond_dtype": None,
        "optimizer.normalize_grads": False, "optimizer.preconditioner_update_probability": 0.05,
        "optimizer.update_prob_flat_start": 500, "optimizer.max_size_triangular": 25000,
        "optimizer.min_ndim_triangular": 2, "optimizer.memory_save_mode": None, "optimizer.preconditioner_lr": 0.1,
        "optimizer.preconditioner_init_scale": 1.0,
        "optimizer.adam_lr": 1e-3, "optimizer.momentum": 0.9, "optimizer.backend_steps": 3,
        "optimizer.muon_epsilon": 1e-7, "optimizer.use_kimi_scaling": True, "optimizer.lr": 0.02,
        "optimizer.scion_to_signum_lr": 0.5, "optimizer.scion_epsilon": 1e-7,
        "data.enforce_eos": True, "data.format": {"type": "text"}, "data.text_key": "text", "data.tags": ["a"],
        "data.cache_options": {}, "data.ignore_token_id": -100,
        "data.shuffle": False, "data.permutation_type": None,
        "data.configs": {"a": {"train_urls": ["a.jsonl"], "validation_urls": ["b.jsonl"]}},
        "data.train_weights": [[0, {"a": 1.0}]], "data.mixture_block_size": 2048, "data.stop_strategy": "restart",
        "data.max_train_batches": None, "data.num_validation_sequences": None, "data.target_budget": None,
        "data.experiment_budget": None,
        "z_loss_weight": 0.1, "eval_harness": {"task_spec": ["piqa"]}, "eval_harness_steps": 1000,
        "initialize_from_hf": False, "use_hf_model_config": False, "hf_save_path": None, "hf_upload": None,
        "hf_save_steps": 10000, "hf_save_dtype": None, "data_seed": None, "initialize_from_checkpoint_path": None,
        "epoch": 0, "log_entropy": False,
        "model.n_routed_experts": 4, "model.num_experts_per_tok": 2, "model.n_shared_experts": 0,
        "model.lbl_coef": 0.01, "model.rzl_coef": 0.001,
        # sft.py and lora_lm.py (levanter_sft.py)
        "dataset_type": "chat_jsonl", "supervised_data": {"cache_dir": "c"}, "chat_train_urls": ["a.jsonl"],
        "max_seq_len": 64, "model_name_or_path": "m", "tokenizer": str(REPO / "README.md"), "messages_field": "messages",
        "input_role": "user", "output_role": "assistant", "reinit_tokens": False, "reinit_lm_head": True,
        "reinit_embeddings": True, "lora.r": 8, "lora.alpha": 16.0, "lora.dropout": 0.1,
        "lora.target_modules": ["o_proj"], "max_train_length": 32, "peft_save_path": None, "peft_hf_upload": None,
        "merged_hf_save_path": None, "merged_hf_upload": None, "trust_remote_code": False,
    },
    "fms-fsdp": {
        "model_variant": "llama_tiny", "ckpt_load_path": "ck", "ckpt_save_path": "ck", "use_dummy_dataset": False,
        "data_path": "d", "datasets": "a,b", "weights": "1,1", "seq_length": 32, "vocab_size": 256,
        "sharding_strategy": "hsdp", "fsdp_activation_checkpointing": True, "selective_checkpointing": 0.5,
        "mixed_precision": True, "low_cpu_fsdp": False, "batch_size": 2, "num_steps": 3, "learning_rate": 1e-3,
        "grad_clip_thresh": 1.0, "seed": 1, "use_profiler": True, "report_interval": 5, "checkpoint_interval": 10,
        "tracker": "wandb", "tracker_dir": "logs", "tracker_project_name": "p", "tracker_run_id": "r",
        "use_torch_compile": True, "file_type": "arrow", "col_name": "tokens", "tokenizer_path": "t", "bos_token": 1,
        "eos_token": 0, "bol_token": None, "eol_token": None, "strip_tokens": "5", "logical_shards": 1024,
        "num_workers": 2, "training_stage": "initial", "resuming_dataset": False, "profiler_rank0_only": False,
    },
}
DIALECT_CONTEXT: dict[str, dict[str, object]] = {
    "trainer.tracker.logdir": {"trainer.tracker.type": "tensorboard"},
    "model.mlp_scale": {"model.type": "gpt2"},
    "model.activation_function": {"model.type": "gpt2"},
    **{f"trainer.tracker.{f}": {"trainer.tracker.type": "tensorboard"}
       for f in ("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix", "write_to_disk")},
    **{f"model.rope.{f}": {"model.rope.type": "llama3"}
       for f in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")},
    **{f"model.rope.{f}": {"model.rope.type": "yarn"} for f in ("beta_fast", "beta_slow", "mscale")},
    "eval_harness": {"eval_harness_steps": 1000},
    "data.configs": {"data.train_weights": {"a": 1.0}},  # a mixture: its sources and their weights
    "data.train_weights": {"data.configs": {"a": {"train_urls": ["a.jsonl"]}}},
    "chat_train_urls": {"supervised_data": {"cache_dir": "c"}},
    "max_seq_len": {"initialize_from_hf": "m", "dataset_type": "chat_jsonl"},
    "tokenizer": {"dataset_type": "chat_jsonl"},  # alone it could be the exporter's key too
    "optimizer.eps": {"optimizer.type": "rmsprop"},  # RMSPropMomentumConfig's spelling of epsilon
    "optimizer.schedule_list": {"optimizer.type": "adopt"},
    **{f"optimizer.{f}": {"optimizer.type": "sophia-h"} for f in ("gamma", "clip_threshold", "update_interval",
                                                                    "rng_seed")},
    **{f"optimizer.{f}": {"optimizer.type": "soap"}
       for f in ("shampoo_beta", "precondition_frequency", "max_precond_dim", "merge_small_dims",
                 "target_merged_dim_size", "one_diag", "partition_grads_into_blocks", "block_size")},
    **{f"optimizer.{f}": {"optimizer.type": "kron"}
       for f in ("normalize_grads", "preconditioner_update_probability", "update_prob_flat_start",
                 "max_size_triangular", "min_ndim_triangular", "memory_save_mode", "preconditioner_lr",
                 "preconditioner_init_scale")},
    **{f"optimizer.{f}": {"optimizer.type": "muon"}
       for f in ("adam_lr", "momentum", "backend_steps", "muon_epsilon", "use_kimi_scaling", "lr")},
    **{f"optimizer.{f}": {"optimizer.type": "scion"} for f in ("scion_to_signum_lr", "scion_epsilon")},
    "model.query_pre_attn_scalar": {"model.type": "gemma"},
    **{f"model.{f}": {"model.type": "gemma2"} for f in ("attn_logit_softcapping", "final_logit_softcapping",
                                                        "use_qk_norm")},
    **{f"model.{f}": {"model.type": "gemma3"} for f in ("sliding_window_pattern", "rope_local_base_freq")},
    **{f"model.{f}": {"model.type": "mixtral"}
       for f in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "lbl_coef", "rzl_coef")},
    "model.attention_bias": {"model.type": "olmo2"},  # Olmo2Config's field
}
"""Levanter keys whose meaning depends on another key of their config (its sample's neighbours)."""


@pytest.mark.parametrize("dialect", sorted(DIALECT_SAMPLES))
def test_every_dialect_key_becomes_keys_a_component_reads(dialect: str) -> None:
    from megatron.neox_arguments.dialects import fms, levanter
    from megatron.neox_arguments.dialects.common import NOTE, Context, Leaf

    module = {"levanter": levanter, "fms-fsdp": fms}[dialect]
    samples = DIALECT_SAMPLES[dialect]
    assert sorted(module.RULES) == sorted(samples), "give every dialect rule a sample value here"
    resolved = finalize(config_from_mapping(MINIMAL), 1, device=Device(cuda=False, fp16_supported=False))
    # read by a component (every such key has an effect test: test_every_supported_key_has_a_test_showing_its_effect)
    honoured = (keys_read(resolved.args) | set(FILLED_IN_KEYS)) - set(NO_EFFECT_KEYS)
    unread: dict[str, list[str]] = {}
    for path, value in samples.items():
        # fms-fsdp's samples make one consistent config; Levanter's are tried one by one
        leaves = {p: Leaf(p, v, "sample") for p, v in samples.items()} if dialect == "fms-fsdp" else {}
        leaves[path] = Leaf(path, value, "sample")
        for other, other_value in DIALECT_CONTEXT.get(path, {}).items():  # e.g. a TensorBoard tracker's field
            leaves[other] = Leaf(other, other_value, "sample")
        context = Context(leaves)
        neox = module.RULES[path](value, context)
        for name in (n for n in neox if n != NOTE):  # NOTE: why nothing is set (shown by --dry-run)
            assert NeoXArgs.has_field(name) and NeoXArgs.is_supported(name), (path, name)
            if name not in honoured:
                unread.setdefault(path, []).append(name)
    assert unread == {}, f"dialect keys that become keys no component reads: {unread}"
