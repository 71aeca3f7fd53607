"""Data, objectives, batch length, regularisation and fp16 loss scaling: the keys of a training run
that are not the architecture and not yet declared beside their component (the loop's, the
optimizer's and activation checkpointing's are, in ``megatron/training/``).

Besides GPT-NeoX's keys it holds Deepy's extras: Levanter-style data URLs and an overflow guard for fp16.
GPT-NeoX's checkpoint keys and tokenizer files live beside the components that read them
(``megatron/checkpointing/config.py``, ``megatron/tokenizer/config.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from megatron.config_support import partly_supported
from megatron import plugins
from megatron.config_schema import ArgGroup, not_supported
from megatron.training.objectives.registry import NOT_BUILT as OBJECTIVES_NOT_BUILT


class TrainingArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTraining`` group."""

    data_path: str | None = None
    """Prefix of one tokenized dataset (`<prefix>.bin/.idx`) that is split into train/valid/test by
    `split`."""

    use_shared_fs: bool = True
    """All nodes see the same filesystem, so only one rank needs to build the sample index."""

    train_data_paths: list[str] | None = None
    """Prefixes of the training datasets, blended by train_data_weights."""

    train_label_data_paths: list[str] | None = None
    """Per-token labels parallel to train_data_paths (-100 masks a token from the loss)."""

    train_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to train_data_paths (reward-model and KTO training)."""

    test_data_paths: list[str] | None = None
    """Prefixes of the test datasets."""

    test_label_data_paths: list[str] | None = None
    """Per-token labels parallel to test_data_paths."""

    test_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to test_data_paths."""

    valid_data_paths: list[str] | None = None
    """Prefixes of the validation datasets."""

    valid_label_data_paths: list[str] | None = None
    """Per-token labels parallel to valid_data_paths."""

    valid_reward_data_paths: list[str] | None = None
    """Per-sample rewards parallel to valid_data_paths."""

    pos_train_data_paths: list[str] | None = None
    """Chosen (preferred) responses for pairwise training."""

    neg_train_data_paths: list[str] | None = None
    """Rejected responses for pairwise training, aligned with pos_train_data_paths."""

    pos_train_label_data_paths: list[str] | None = None
    """Labels for the chosen training responses."""

    neg_train_label_data_paths: list[str] | None = None
    """Labels for the rejected training responses."""

    pos_valid_data_paths: list[str] | None = None
    """Chosen responses for pairwise validation."""

    neg_valid_data_paths: list[str] | None = None
    """Rejected responses for pairwise validation."""

    pos_valid_label_data_paths: list[str] | None = None
    """Labels for the chosen validation responses."""

    neg_valid_label_data_paths: list[str] | None = None
    """Labels for the rejected validation responses."""

    pos_test_data_paths: list[str] | None = None
    """Chosen responses for pairwise testing."""

    neg_test_data_paths: list[str] | None = None
    """Rejected responses for pairwise testing."""

    pos_test_label_data_paths: list[str] | None = None
    """Labels for the chosen test responses."""

    neg_test_label_data_paths: list[str] | None = None
    """Labels for the rejected test responses."""

    train_data_weights: list[float] | None = None
    """Sampling weight of each training dataset; unset means equal weights."""

    valid_data_weights: list[float] | None = None
    """Sampling weight of each validation dataset."""

    test_data_weights: list[float] | None = None
    """Sampling weight of each test dataset."""

    weight_by_num_documents: bool = False
    """Derive blending weights from document counts instead of the *_data_weights lists."""

    weighted_sampler_alpha: float = Field(1.0, ge=0)
    """Exponent on each dataset's document share for weight_by_num_documents (GPT-NeoX's formula)."""

    data_impl: Literal["infer", "mmap", "cached"] = (
        partly_supported("infer", unsupported=("cached",))
    )
    """On-disk dataset format; `infer` reads it from the files."""

    pack_impl: Literal["packed", "pack_until_overflow", "unpacked"] = "packed"
    """How documents fill samples: packed back to back, packed until one would overflow, or one
    document per sample."""

    dataset_impl: Literal["gpt2", "pairwise", "online"] = (
        partly_supported("gpt2", unsupported=("online",))
    )
    """Kind of dataset: plain text (gpt2), chosen/rejected pairs, or online rollouts."""

    train_impl: str = partly_supported("normal", unsupported=OBJECTIVES_NOT_BUILT)
    """Training objective, a registered objective plug-in (``megatron/training/objectives/registry.py``):
    language modelling or label-masked SFT (normal), DPO on preference pairs, a pairwise reward model
    with a scalar head (rm), KTO on rewarded completions; GPT-NeoX's REINFORCE is not built yet. Each
    objective declares its own keys (dpo_*, kto_*, reset_*)."""

    @field_validator("train_impl")
    @classmethod
    def _registered_objective(cls, value: str) -> str:
        return plugins.validate_name("train_impl", value, not_built=OBJECTIVES_NOT_BUILT)

    z_loss: float = Field(0.0, ge=0)
    """Z-loss weight: language modelling adds z_loss x (log Z)^2 per counted token (the softmax
    normaliser, PaLM); a reward model adds z_loss x (s_chosen^2 + s_rejected^2) per pair (GPT-NeoX)."""

    fp32_reinforce: bool = not_supported(True)
    """Compute REINFORCE log-probabilities in fp32."""

    kl_impl: Literal["abs", "mse", "kl", "full"] = not_supported("mse")
    """Estimator of the KL penalty in REINFORCE."""

    kl_div_beta: float = not_supported(0.1)
    """Weight of the KL penalty in REINFORCE."""

    reinforce_leave_one_out: bool = not_supported(False)
    """Use the leave-one-out baseline in REINFORCE."""

    allow_chopped: bool = True
    """Keep pairwise samples whose text had to be cut to fit seq_length."""

    mmap_warmup: bool = False
    """Touch every page of the mmapped data at start-up so the first steps are not I/O bound."""

    s3_path: str | None = not_supported(None)
    """Also upload checkpoints to this S3 prefix."""

    s3_chunk_size: int = not_supported(104857600)
    """Chunk size in bytes for S3 uploads."""

    no_save_optim: bool = not_supported(False)
    """Leave optimizer state out of checkpoints (smaller, but cannot resume exactly)."""

    batch_size: int | None = Field(None, ge=1)
    """Micro-batch size per data-parallel rank; an older name for train_micro_batch_size_per_gpu."""


    split: str = "969, 30, 1"
    """Train/valid/test proportions for data_path, as comma-separated weights."""


    clip_grad: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    hysteresis: int = Field(2, ge=1)
    """fp16: number of overflowed steps tolerated before the loss scale is lowered."""

    dynamic_loss_scale: bool | None = None
    """fp16: adapt the loss scale to overflows; unset means dynamic unless loss_scale is given."""

    loss_scale: float | None = Field(None, ge=0)
    """fp16: a fixed loss scale; unset or 0 means dynamic."""

    loss_scale_window: float = Field(1000.0, gt=0)
    """fp16: number of overflow-free steps before the loss scale is raised."""

    min_scale: float = Field(1.0, gt=0)
    """fp16: lowest loss scale allowed."""

    char_level_ppl: bool = not_supported(False)
    """Also report perplexity per character, which compares across tokenizers."""

    use_mup: bool = not_supported(False)
    """Parametrise the model with muP so hyperparameters transfer across widths."""

    coord_check: bool = not_supported(False)
    """Run muP's coordinate check instead of training."""

    save_base_shapes: bool = not_supported(False)
    """Write muP base shapes to base_shapes_file and exit."""

    base_shapes_file: str | None = not_supported(None)
    """muP base shapes file."""

    mup_init_scale: float = not_supported(1.0)
    """muP: multiplier on initial weights."""

    mup_attn_temp: float = not_supported(1.0)
    """muP: attention temperature."""

    mup_output_temp: float = not_supported(1.0)
    """muP: output logit temperature."""

    mup_embedding_mult: float = not_supported(1.0)
    """muP: multiplier on embedding outputs."""

    mup_rp_embedding_mult: float = not_supported(1.0)
    """muP: multiplier on relative position embeddings."""

    mup_width_scale: int = not_supported(2)
    """muP: width ratio of the target model to the base model."""

    # ---- Deepy extras (not in GPT-NeoX) ----

    use_dummy_dataset: bool = False
    """Train on random tokens without any data files (smoke tests and benchmarks)."""

    train_urls: list[str] | None = None
    """Raw-text shards (local paths or URLs, jsonl/jsonl.zst) tokenized on the fly for training
    (Levanter-style)."""

    validation_urls: list[str] | None = None
    """Raw-text shards for validation, as train_urls."""

    cache_dir: str | None = None
    """Where tokenized shards from train_urls/validation_urls are cached."""

    reference_logps: str | None = None
    """DPO: the precompute_model_name of reference log-probs written by `generate.py
    text_gen_type=precompute` next to each chosen/rejected dataset (`<prefix>_<name>.bin/.idx`);
    unset uses a frozen copy of the starting weights."""


    per_device_parallelism: int | None = Field(None, ge=1)
    """Levanter's name for the micro batch per device; read as train_micro_batch_size_per_gpu."""

    run_dir: str | None = None
    """Directory where the resolved config (deepy_config.json) is written; unset derives one from
    log_dir or save."""
