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
        "optimizer.min_lr_ratio": 0.1, "optimizer.warmup": 0.1, "optimizer.warmup_ratio": 0.1, "optimizer.decay": 0.5,
        "optimizer.lr_schedule": "linear", "optimizer.cycles": 2, "optimizer.rewarmup": 0.1,
        "data.train_urls": ["a.jsonl"], "data.validation_urls": ["b.jsonl"], "data.cache_dir": "c",
        "data.tokenizer": str(REPO / "README.md"),
    },
    "fms-fsdp": {
        "model_variant": "llama_tiny", "ckpt_load_path": "ck", "ckpt_save_path": "ck", "use_dummy_dataset": False,
        "data_path": "d", "datasets": "a,b", "weights": "1,1", "seq_length": 32, "vocab_size": 256,
        "sharding_strategy": "hsdp", "fsdp_activation_checkpointing": True, "selective_checkpointing": 0.5,
        "mixed_precision": True, "low_cpu_fsdp": False, "batch_size": 2, "num_steps": 3, "learning_rate": 1e-3,
        "grad_clip_thresh": 1.0, "seed": 1, "use_profiler": True, "report_interval": 5, "checkpoint_interval": 10,
        "tracker": "wandb", "tracker_dir": "logs", "tracker_project_name": "p", "tracker_run_id": "r",
        "use_torch_compile": True,
    },
}


@pytest.mark.parametrize("dialect", sorted(DIALECT_SAMPLES))
def test_every_dialect_key_becomes_keys_a_component_reads(dialect: str) -> None:
    from megatron.neox_arguments.dialects import fms, levanter
    from megatron.neox_arguments.dialects.common import Context, Leaf

    module = {"levanter": levanter, "fms-fsdp": fms}[dialect]
    samples = DIALECT_SAMPLES[dialect]
    assert sorted(module.RULES) == sorted(samples), "give every dialect rule a sample value here"
    resolved = finalize(config_from_mapping(MINIMAL), 1, device=Device(cuda=False, fp16_supported=False))
    honoured = keys_read(resolved.args) | set(EFFECT_TESTS)
    unread: dict[str, list[str]] = {}
    for path, value in samples.items():
        # fms-fsdp's samples make one consistent config; Levanter's are tried one by one
        leaves = {p: Leaf(p, v, "sample") for p, v in samples.items()} if dialect == "fms-fsdp" else {}
        leaves[path] = Leaf(path, value, "sample")
        if path == "trainer.tracker.logdir":  # a TensorBoard tracker's field
            leaves["trainer.tracker.type"] = Leaf("trainer.tracker.type", "tensorboard", "sample")
        context = Context(leaves)
        neox = module.RULES[path](value, context)
        for name in neox:
            assert NeoXArgs.has_field(name) and NeoXArgs.is_supported(name), (path, name)
            if name not in honoured:
                unread.setdefault(path, []).append(name)
    assert unread == {}, f"dialect keys that become keys no component reads: {unread}"
