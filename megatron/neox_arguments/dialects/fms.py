"""IBM fms-fsdp's dialect: the flat ``train_config`` keys, as ``--key=value`` flags or in a YAML file.

Meanings follow fms-fsdp's ``fms_fsdp/config/training.py``, ``main_training_llama.py`` and
``scripts/train.sh``. The model is one of fms-fsdp's Llama variants (``model_variant``), plus small
ones for tests. ``docs/dialects.md`` lists every key and what it became.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from megatron.neox_arguments.dialects.common import Context, Leaf, Refused, Rule, Translation, to

NAME = "fms-fsdp"


def _llama(hidden: int, layers: int, heads: int, ffn: int, kv: int | None = None, vocab: int = 32000,
           seq: int = 4096, theta: int = 10000) -> dict[str, Any]:
    return dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu", no_weight_tying=True,
                use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False,
                rms_norm_epsilon=1e-5, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                num_kv_heads=kv or heads, intermediate_size=ffn, rotary_emb_base=theta,
                max_position_embeddings=seq, padded_vocab_size=vocab)


MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    # fms-fsdp's Llama presets (sizes of the published Llama 2 / Llama 3 models)
    "7b": _llama(4096, 32, 32, 11008),
    "llama2_7b": _llama(4096, 32, 32, 11008),
    "13b": _llama(5120, 40, 40, 13824),
    "llama2_13b": _llama(5120, 40, 40, 13824),
    "70b": _llama(8192, 80, 64, 28672, kv=8),
    "llama2_70b": _llama(8192, 80, 64, 28672, kv=8),
    "llama3_8b": _llama(4096, 32, 32, 14336, kv=8, vocab=128256, seq=8192, theta=500000),
    "llama3_70b": _llama(8192, 80, 64, 28672, kv=8, vocab=128256, seq=8192, theta=500000),
    # Deepy's small variants, for tests and CPU smoke runs
    "llama_tiny": _llama(64, 2, 4, 172, vocab=256, seq=256),
    "llama_small": _llama(512, 8, 8, 1376, vocab=32000, seq=2048),
}


# fms-fsdp's Mamba variants (fms_fsdp/utils/config_utils.py, commit 5a296afe, trained by main_training_mamba.py
# with mamba_ssm's MambaLMHeadModel), and why none maps onto Deepy's Mamba (GPT-NeoX's Mamba-1 layer)
MAMBA_VARIANTS: dict[str, str] = {
    "mamba_9.8b": "a Mamba-2 hybrid (ssm_cfg layer Mamba2: multi-head SSD mixers; a 14336-wide MLP in each of its 32 "
                  "blocks; attention in blocks 9, 18 and 27); Deepy builds GPT-NeoX's Mamba-1 layers "
                  "(attention_config: mamba), which compute another function: not supported",
}


def _variant(value: Any, ctx: Context) -> dict[str, Any]:
    if str(value) in MAMBA_VARIANTS:
        raise Refused(f"fms-fsdp's {value} is {MAMBA_VARIANTS[str(value)]}")
    if str(value) not in MODEL_VARIANTS:
        raise Refused(f"unknown model_variant; Deepy has {', '.join(MODEL_VARIANTS)}")
    return {}  # the preset is implied, so seq_length/vocab_size given explicitly win


def _seq_length(value: Any, ctx: Context) -> dict[str, Any]:
    return {"seq_length": value, "max_position_embeddings": value}


def _datasets(ctx: Context) -> dict[str, Any]:
    """``data_path``/<each of datasets>, weighted by ``weights``: Deepy datasets prepared with
    prepare_data.py (fms-fsdp's arrow shards are not read)."""
    if ctx.value("use_dummy_dataset", False):
        return {}
    root = str(ctx.value("data_path", "/fsx/data"))
    names = [n for n in str(ctx.value("datasets", "")).split(",") if n]
    if not names:
        raise Refused("give datasets: a comma-separated list of dataset prefixes under data_path")
    values: dict[str, Any] = {"train_data_paths": [f"{root.rstrip('/')}/{name}" for name in names]}
    weights = ctx.value("weights")
    if weights is not None:
        parts = [float(w) for w in str(weights).split(",") if w]
        if len(parts) != len(names):
            raise Refused(f"{len(parts)} weights for {len(names)} datasets")
        values["train_data_weights"] = parts
    return values


def _data(value: Any, ctx: Context) -> dict[str, Any]:
    return _datasets(ctx)


def _dummy(value: Any, ctx: Context) -> dict[str, Any]:
    return {"use_dummy_dataset": bool(value), **_datasets(ctx)}


def _every_kth_block(value: Any, ctx: Context) -> dict[str, Any]:
    """fms-fsdp checkpoints a fraction of the blocks (1, 0.5, "1/3"): Deepy's every k-th block."""
    if not ctx.value("fsdp_activation_checkpointing", False):
        return {}  # as in fms-fsdp: the fraction only applies when activation checkpointing is on
    fraction = Fraction(str(value)).limit_denominator(1000)
    if fraction <= 0 or fraction > 1 or fraction.numerator != 1:
        raise Refused("Deepy checkpoints every k-th block, so the fraction must be 1/k (1, 0.5, 1/3, ...)")
    return {"selective_checkpointing": fraction.denominator} if fraction.denominator > 1 else {}


def _mixed_precision(value: Any, ctx: Context) -> dict[str, Any]:
    return {"precision": "bfloat16" if value else "fp32"}


def _sharding(value: Any, ctx: Context) -> dict[str, Any]:
    if str(value) not in ("fsdp", "hsdp", "ddp"):
        raise Refused("use fsdp (ZeRO-3 over every rank), hsdp (sharded within a node) or ddp (plain data parallel)")
    return {"sharding_strategy": str(value)}


def _learning_rate(value: Any, ctx: Context) -> dict[str, Any]:
    """fms-fsdp's schedule: warmup over min(2000, num_steps // 20) steps, then cosine to 0.1 x lr."""
    steps = int(ctx.value("num_steps", FMS_DEFAULTS["num_steps"]))
    return {"lr": value, "lr_decay_style": "cosine", "min_lr_ratio": 0.1, "warmup": float(max(1, min(2000, steps // 20)))}


def _tracker(value: Any, ctx: Context) -> dict[str, Any]:
    kind = ctx.value("tracker")
    if kind in (None, "none", "None"):
        return {}
    if kind != "wandb":
        raise Refused(f"tracker {kind!r} is not built here; use wandb (or leave it out)")
    block: dict[str, Any] = {"type": "wandb", "project": ctx.value("tracker_project_name", "llama")}
    if ctx.value("tracker_run_id"):
        block["id"] = ctx.value("tracker_run_id")
    return {"tracker": block}


def _tracker_dir(value: Any, ctx: Context) -> dict[str, Any]:
    return {"log_dir": value, **_tracker(value, ctx)}


RULES: dict[str, Rule] = {
    "model_variant": _variant,
    "ckpt_load_path": to("load"),
    "ckpt_save_path": to("save"),
    "use_dummy_dataset": _dummy,
    "data_path": _data,
    "datasets": _data,
    "weights": _data,
    "seq_length": _seq_length,
    "vocab_size": to("padded_vocab_size"),
    "sharding_strategy": _sharding,
    "fsdp_activation_checkpointing": to("checkpoint_activations"),
    "selective_checkpointing": _every_kth_block,
    "mixed_precision": _mixed_precision,
    "low_cpu_fsdp": to("zero_init"),
    "batch_size": to("train_micro_batch_size_per_gpu"),
    "num_steps": to("train_iters"),
    "learning_rate": _learning_rate,
    "grad_clip_thresh": to("gradient_clipping"),
    "seed": to("seed"),
    "use_profiler": to("profile"),
    "report_interval": to("log_interval"),
    "checkpoint_interval": to("checkpoint_factor"),
    "tracker": _tracker,
    "tracker_dir": _tracker_dir,
    "tracker_project_name": _tracker,
    "tracker_run_id": _tracker,
    "use_torch_compile": to("compile_layers"),
}

REFUSED: dict[str, str] = {
    "sep_token": "documents are separated when the data is prepared (prepare_data.py appends the end-of-text "
                 "token), not while loading",
    "logical_shards": "Deepy's data order is a function of the consumed samples and the seed, with no logical "
                      "shards to rescale over",
    "profiler_rank0_only": "which ranks profile is not configurable here",
}

FMS_DEFAULTS: dict[str, Any] = {
    "model_variant": "7b",
    "seq_length": 4096,
    "seed": 2023,
    "batch_size": 2,
    "num_steps": 1_000_000,
    "learning_rate": 3e-4,
    "mixed_precision": True,
    "use_torch_compile": True,
    "report_interval": 100,
    "checkpoint_interval": 10_000,
}
"""fms-fsdp's defaults (``train_config``) where GPT-NeoX's differ; paths and the sharding strategy are
never implied (say them)."""


def implied(translation: Translation, leaves: dict[str, Leaf], source: str) -> None:
    ctx = Context(leaves)
    variant = str(ctx.value("model_variant", FMS_DEFAULTS["model_variant"]))
    where = leaves["model_variant"].where if "model_variant" in leaves else "fms-fsdp's default"
    translation.put(Leaf(f"model_variant={variant}", variant, where), MODEL_VARIANTS[variant], implied=True)
    for key, value in FMS_DEFAULTS.items():
        if key not in leaves and key != "model_variant":
            translation.put(Leaf(f"{key}={value}", value, "fms-fsdp's default"), RULES[key](value, ctx), implied=True)
    # fms-fsdp's optimizer: AdamW with betas (0.9, 0.95) and weight decay 0.1
    translation.put(Leaf("AdamW(betas=(0.9, 0.95), weight_decay=0.1)", None, "fms-fsdp"),
                    {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95], "eps": 1e-8}}, "weight_decay": 0.1},
                    implied=True)
    # fms-fsdp trains on token ids with no tokenizer: the ids are read as they are (byte-level
    # tokenizer, end-of-document id 0) over an embedding of vocab_size rows (padded_vocab_size)
    translation.put(Leaf("token ids (no tokenizer)", None, "fms-fsdp"), {"tokenizer_type": "CharLevelTokenizer"},
                    implied=True)
    # fms-fsdp trains without gradient accumulation: the global batch is the micro batch x ranks
    translation.put(Leaf("batch_size (no accumulation)", None, "fms-fsdp"), {"gradient_accumulation_steps": 1},
                    implied=True)


