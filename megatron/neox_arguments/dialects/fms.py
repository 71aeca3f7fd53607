"""IBM fms-fsdp's dialect: the flat ``train_config`` keys, as ``--key=value`` flags or in a YAML file.

Meanings and defaults are read from foundation-model-stack/fms-fsdp at 5a296afe: ``train_config``
(``fms_fsdp/config/training.py``), ``get_model_config`` (``fms_fsdp/utils/config_utils.py``, with
``LLaMAConfig`` of foundation-model-stack at 062adf6e for the defaults a variant leaves), the schedule,
optimizer and checkpointer of ``main_training_llama.py``, and the data loaders of
``fms_fsdp/utils/dataloader_utils.py`` and ``dataset_utils.py``. ``docs/dialects.md`` lists every key
and what it became.
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Any

from megatron.checkpointing.remote import remote_resume_point
from megatron.neox_arguments.dialects.common import Context, Leaf, Refused, Rule, Translation, noted, to
from megatron.object_store import is_remote

NAME = "fms-fsdp"


def fms_llama(emb_dim: int = 4096, nheads: int = 32, kvheads: int = 0, nlayers: int = 32,
              hidden_grow_factor: float = 8 / 3, multiple_of: int = 256, src_vocab_size: int = 32000,
              max_expected_seq_len: int = 4096, rope_theta: float = 10000.0) -> dict[str, Any]:
    """An fms ``LLaMAConfig`` (its defaults as arguments) as GPT-NeoX model keys. The MLP width is
    ``GatedLinearUnit``'s: ``int(hidden_grow_factor * emb_dim)`` rounded up to ``multiple_of``;
    ``kvheads`` 0 means one per head; no biases, untied head, RMSNorm eps 1e-5."""
    ffn = int(hidden_grow_factor * emb_dim)
    if multiple_of:
        ffn = multiple_of * ((ffn + multiple_of - 1) // multiple_of)
    return dict(pos_emb="rotary", norm="rmsnorm", activation="swiglu", no_weight_tying=True,
                use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False,
                rms_norm_epsilon=1e-5, hidden_size=emb_dim, num_layers=nlayers, num_attention_heads=nheads,
                # ffn: each half of the gated MLP; GPT-NeoX's intermediate_size is 3x that (model/mlp_width.py)
                num_kv_heads=kvheads or nheads, intermediate_size=3 * ffn, rotary_emb_base=rope_theta,
                max_position_embeddings=max_expected_seq_len, padded_vocab_size=src_vocab_size)


_L3: dict[str, Any] = dict(src_vocab_size=128256, rope_theta=500000.0)
MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    # get_model_config, in its order
    "llama2_70b": fms_llama(emb_dim=8192, multiple_of=4096, nheads=64, kvheads=8, nlayers=80,
                            hidden_grow_factor=28672 / 8192),
    "llama2_34b": fms_llama(emb_dim=8192, nheads=64, kvheads=8, nlayers=48, hidden_grow_factor=22016 / 8192,
                            max_expected_seq_len=16384, rope_theta=1000000.0),
    "llama2_13b": fms_llama(emb_dim=5120, nheads=40, nlayers=40, hidden_grow_factor=13824 / 5120),
    "llama2_7b": fms_llama(hidden_grow_factor=11008 / 4096, kvheads=32),
    "llama2_1.4b": fms_llama(emb_dim=2048, nheads=16, nlayers=24, hidden_grow_factor=3, kvheads=4),
    "llama3_8b": fms_llama(emb_dim=4096, nheads=32, kvheads=8, nlayers=32, hidden_grow_factor=3.5,
                           max_expected_seq_len=8192, **_L3),
    "llama3_8b_4k": fms_llama(emb_dim=4096, nheads=32, kvheads=8, nlayers=32, hidden_grow_factor=3.5,
                              max_expected_seq_len=4096, **_L3),
    "llama3_1.8b": fms_llama(emb_dim=2048, nheads=16, kvheads=8, nlayers=24, hidden_grow_factor=3.5,
                             max_expected_seq_len=8192, **_L3),
    "llama3_1.8b_4k": fms_llama(emb_dim=2048, nheads=16, kvheads=8, nlayers=24, hidden_grow_factor=3.5,
                                max_expected_seq_len=4096, **_L3),
    "llama3_3.2b": fms_llama(emb_dim=3072, nheads=24, kvheads=8, nlayers=24, hidden_grow_factor=8 / 3,
                             max_expected_seq_len=8192, **_L3),
    "llama3_3.2b_4k": fms_llama(emb_dim=3072, nheads=24, kvheads=8, nlayers=24, hidden_grow_factor=8 / 3,
                                max_expected_seq_len=4096, **_L3),
    "llama3_70b": fms_llama(emb_dim=8192, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=3.5,
                            max_expected_seq_len=8192, **_L3),
    "llama3_70b_4k": fms_llama(emb_dim=8192, nheads=64, kvheads=8, nlayers=80, hidden_grow_factor=3.5,
                               max_expected_seq_len=4096, **_L3),
    "llama3_194m_4k": fms_llama(emb_dim=1024, nheads=8, nlayers=10, max_expected_seq_len=4096, **_L3),
    # Deepy's small variants, for tests and CPU smoke runs (not fms-fsdp's); llama_tiny's 8192 rows hold the ids of
    # the README's pydocs data (prepare_data.py's 8192-token tokenizer), so train.sh trains it on that data
    "llama_tiny": fms_llama(emb_dim=64, nlayers=2, nheads=4, hidden_grow_factor=172 / 64, multiple_of=0,
                            src_vocab_size=8192, max_expected_seq_len=256),
    "llama_small": fms_llama(emb_dim=512, nlayers=8, nheads=8, hidden_grow_factor=1376 / 512, multiple_of=0,
                             max_expected_seq_len=2048),
}

OLD_NAMES = {"70b": "llama2_70b", "34b": "llama2_34b", "13b": "llama2_13b", "7b": "llama2_7b", "1.4b": "llama2_1.4b"}
"""fms-fsdp's names before its commit be50bb6 (2024-05-16) renamed them llama2_*. ``train_config`` still
defaults to ``7b``, which ``get_model_config`` at 5a296afe no longer knows; Deepy reads the old names."""

# fms-fsdp's Mamba variants (fms_fsdp/utils/config_utils.py, commit 5a296afe, trained by main_training_mamba.py
# with mamba_ssm's MambaLMHeadModel), and why none maps onto Deepy's Mamba (GPT-NeoX's Mamba-1 layer)
MAMBA_VARIANTS: dict[str, str] = {
    "mamba_9.8b": "a Mamba-2 hybrid (ssm_cfg layer Mamba2: multi-head SSD mixers; a 14336-wide MLP in each of its 32 "
                  "blocks; attention in blocks 9, 18 and 27); Deepy builds GPT-NeoX's Mamba-1 layers "
                  "(attention_config: mamba), which compute another function: not supported",
}


def variant_name(ctx: Context) -> str:
    name = str(ctx.value("model_variant", FMS_DEFAULTS["model_variant"]))
    if name in MAMBA_VARIANTS:
        raise Refused(f"fms-fsdp's {name} is {MAMBA_VARIANTS[name]}")
    name = OLD_NAMES.get(name, name)
    if name not in MODEL_VARIANTS:
        raise Refused(f"unknown model_variant; fms-fsdp's are {', '.join(n for n in MODEL_VARIANTS if '_' in n and not n.startswith('llama_'))}"
                      f" (and the older {', '.join(OLD_NAMES)}), Deepy's small ones llama_tiny, llama_small")
    return name


def _variant(value: Any, ctx: Context) -> dict[str, Any]:
    variant_name(ctx)
    return {}  # the preset is implied


def _embedding_rows(ctx: Context) -> int:
    return int(MODEL_VARIANTS[variant_name(ctx)]["padded_vocab_size"])


# ------------------------------------------------------------------------------------------- data

_FILE_TYPES = ("arrow", "hf_parquet", "auto")


def _datasets(ctx: Context) -> dict[str, Any]:
    """``data_path``/<each of ``datasets``>: directories of token shards, read as fms-fsdp's
    ``StreamingDocDataset`` reads them (tokenized once into ``cache_dir``), blended by ``weights``."""
    if ctx.value("use_dummy_dataset", False):
        return {}
    root = str(ctx.value("data_path", FMS_DEFAULTS["data_path"]))
    names = [n.strip() for n in str(ctx.value("datasets", FMS_DEFAULTS["datasets"])).split(",") if n.strip()]
    if not names:
        raise Refused("datasets lists no dataset directory")
    weights = [float(w) for w in str(ctx.value("weights", FMS_DEFAULTS["weights"])).split(",") if w.strip()]
    if len(weights) != len(names):  # SamplingDataset asserts it
        raise Refused(f"{len(weights)} weights for {len(names)} datasets")
    if any(w <= 0 for w in weights):
        raise Refused("every sampling weight must be positive (SamplingDataset asserts it)")
    return {"train_data_paths": [os.path.join(root, name) for name in names], "train_data_weights": weights}


def _data(value: Any, ctx: Context) -> dict[str, Any]:
    return _datasets(ctx)


def _dummy(value: Any, ctx: Context) -> dict[str, Any]:
    """fms-fsdp's ``SteadyCounter``: consecutive ids modulo ``vocab_size``, the targets being the inputs."""
    if not value:
        return {"use_dummy_dataset": False, **_datasets(ctx)}
    return {"use_dummy_dataset": True, "dummy_data": "counter", **_vocab_size(ctx.value("vocab_size", 32000), ctx)}


def _vocab_size(value: Any, ctx: Context) -> dict[str, Any]:
    """In fms-fsdp only the dummy data reads ``vocab_size`` (the model variant decides the embedding)."""
    if not ctx.value("use_dummy_dataset", False):
        return noted("only fms-fsdp's dummy data reads vocab_size; the model variant decides the embedding")
    rows = _embedding_rows(ctx)
    if int(value) > rows:
        raise Refused(f"the dummy data's ids run up to vocab_size - 1 = {int(value) - 1}, beyond the "
                      f"{rows} embedding rows of {variant_name(ctx)}; give --vocab_size <= {rows}")
    return {"dummy_data_vocab_size": int(value)}


def _file_type(value: Any, ctx: Context) -> dict[str, Any]:
    if value not in _FILE_TYPES:
        raise Refused(f"file_type is one of {', '.join(_FILE_TYPES)} (dataloader_utils._handler_map)")
    return {"shard_file_type": value}


def _col_name(value: Any, ctx: Context) -> dict[str, Any]:
    if ctx.value("file_type", "arrow") == "arrow":
        if value != "tokens":
            raise Refused("with file_type arrow fms-fsdp builds ArrowHandler() without col_name: it reads the "
                          "'tokens' column; use file_type hf_parquet or auto for another column")
        return noted("arrow shards' 'tokens' column")
    return {"shard_column": value}


def _tokenizer_path(value: Any, ctx: Context) -> dict[str, Any]:
    if ctx.value("file_type", "arrow") == "arrow":
        return noted("arrow shards hold token ids: no tokenizer is read")
    if not os.path.isdir(str(value)):
        raise Refused(f"{value} is not a local tokenizer directory (nothing is downloaded)")
    return {"shard_tokenizer": str(value)}


def _token(name: str) -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if name in ("bol_token", "eol_token"):
            if value is not None:
                raise Refused(f"{name} (a token added at the {'start' if name == 'bol_token' else 'end'} of every "
                              f"packed line) is not built here")
            return noted("none")
        return {"shard_bos_token" if name == "bos_token" else "shard_eos_token": value}
    return rule


def _strip_tokens(value: Any, ctx: Context) -> dict[str, Any]:
    return {"shard_strip_tokens": [int(x) for x in str(value).split(",") if x.strip()]}


def _logical_shards(value: Any, ctx: Context) -> dict[str, Any]:
    if int(value) != FMS_DEFAULTS["logical_shards"]:
        raise Refused("logical shards make fms-fsdp's data order rescalable to other world sizes; Deepy's order is "
                      "a function of the consumed samples and the seed, so another count has no effect here")
    return noted("fms-fsdp's default; Deepy's data order is a function of the consumed samples and the seed")


# --------------------------------------------------------------------------------------- training


def _every_kth_block(value: Any, ctx: Context) -> dict[str, Any]:
    """fms-fsdp checkpoints a fraction p of the blocks (1, 0.5, "1/3"): Deepy's every k-th block."""
    if not ctx.value("fsdp_activation_checkpointing", False):
        return noted("read only with fsdp_activation_checkpointing, as in fms-fsdp")
    fraction = Fraction(str(value)).limit_denominator(1000)
    if fraction <= 0 or fraction > 1 or fraction.numerator != 1:
        raise Refused("Deepy checkpoints every k-th block, so the fraction must be 1/k (1, 0.5, 1/3, ...)")
    return {"selective_checkpointing": fraction.denominator} if fraction.denominator > 1 else {}


def _mixed_precision(value: Any, ctx: Context) -> dict[str, Any]:
    return {"precision": "bfloat16" if value else "fp32"}


def _sharding(value: Any, ctx: Context) -> dict[str, Any]:
    strategy = str(value).lower()  # fms-fsdp's docs write FSDP/HSDP
    if strategy not in ("fsdp", "hsdp", "ddp"):
        raise Refused("use fsdp (ZeRO-3 over every rank), hsdp (sharded within a node) or ddp (plain data parallel)")
    return {"sharding_strategy": strategy}


def _stage(value: Any, ctx: Context) -> dict[str, Any]:
    if value not in ("initial", "annealing"):
        raise Refused("training_stage is initial (warmup + cosine) or annealing (linear to 0)")
    return {"lr_decay_style": "fms" if value == "initial" else "fms_annealing"}


def _tracker(value: Any, ctx: Context) -> dict[str, Any]:
    kind = ctx.value("tracker")
    if kind in (None, "none", "None"):
        return {}
    if kind != "wandb":
        raise Refused(f"tracker {kind!r} is not built here; use wandb (or leave it out)")
    block: dict[str, Any] = {"type": "wandb", "project": ctx.value("tracker_project_name", "llama")}
    if ctx.value("tracker_run_id"):
        block["id"] = ctx.value("tracker_run_id")
    return {"tracker": block, "log_dir": ctx.value("tracker_dir", FMS_DEFAULTS["tracker_dir"])}


def _tracker_dir(value: Any, ctx: Context) -> dict[str, Any]:
    """Where the tracker writes (W&B's ``dir``); Deepy's own metrics.jsonl goes there too."""
    return {"log_dir": value, **_tracker(value, ctx)}


def _checkpoints(key: str) -> Rule:
    """fms-fsdp's ``Checkpointer`` keeps its checkpoints in ``<ckpt_save_path>/checkpoints/`` and loads
    from ``<ckpt_load_path>/checkpoints/``."""
    return lambda value, ctx: {key: os.path.join(str(value), "checkpoints")}


def _load_checkpoints(value: Any, ctx: Context) -> dict[str, Any]:
    """fms-fsdp's ``Checkpointer.load`` resumes from ``<ckpt_save_path>/checkpoints`` when it holds one (a
    restart), else from ``<ckpt_load_path>/checkpoints`` when that holds one, else starts from scratch with
    "No valid checkpoint detected" (fms_fsdp/utils/checkpointing_utils.py:165-211 at 5a296afe). A load
    directory that holds nothing on this machine is that last case: no ``load``, the run starts fresh."""
    load = os.path.join(str(value), "checkpoints")
    save = os.path.join(str(ctx.value("ckpt_save_path", FMS_DEFAULTS["ckpt_save_path"])), "checkpoints")
    if os.path.normpath(load) != os.path.normpath(save) and not _holds_something(load):
        return noted(f"{load} holds no checkpoint here: fms-fsdp starts from scratch, and so does this run")
    return {"load": load}


def _holds_something(load: str) -> bool:
    """A directory with files, or a bucket's prefix with committed checkpoints."""
    if is_remote(load):
        try:
            return remote_resume_point(load) is not None
        except Exception:  # noqa: BLE001 - the store's own errors; the check before launch names them
            return False
    return os.path.isdir(load) and bool(os.listdir(load))


def _resuming_dataset(value: Any, ctx: Context) -> dict[str, Any]:
    load = ctx.value("ckpt_load_path", FMS_DEFAULTS["ckpt_load_path"])
    if load != ctx.value("ckpt_save_path", FMS_DEFAULTS["ckpt_save_path"]):
        raise Refused("with ckpt_load_path other than ckpt_save_path, Deepy resumes the data of the checkpoint it "
                      "loads; fms-fsdp's choice of data state is not built")
    return noted("loading from ckpt_save_path, both values resume the data where the checkpoint stopped")


_RANK0 = ("fms-fsdp's profiler traces rank 0 only unless profiler_rank0_only is false; Deepy's traces every rank: "
          "give --profiler_rank0_only=False with --use_profiler=True")


def _profiler(value: Any, ctx: Context) -> dict[str, Any]:
    if value and ctx.value("profiler_rank0_only", True):
        raise Refused(_RANK0)
    return {"profile": bool(value)}


def _rank0_profiler(value: Any, ctx: Context) -> dict[str, Any]:
    if not value:
        return noted("every rank is traced, as Deepy's profiler does")
    if ctx.value("use_profiler", False):
        raise Refused(_RANK0)
    return noted("no profiler runs (use_profiler is false)")


RULES: dict[str, Rule] = {
    "model_variant": _variant,
    "ckpt_load_path": _load_checkpoints,
    "ckpt_save_path": _checkpoints("save"),
    "use_dummy_dataset": _dummy,
    "data_path": _data,
    "datasets": _data,
    "weights": _data,
    "file_type": _file_type,
    "col_name": _col_name,
    "tokenizer_path": _tokenizer_path,
    "seq_length": to("seq_length"),
    "vocab_size": _vocab_size,
    "bos_token": _token("bos_token"),
    "eos_token": _token("eos_token"),
    "bol_token": _token("bol_token"),
    "eol_token": _token("eol_token"),
    "strip_tokens": _strip_tokens,
    "logical_shards": _logical_shards,
    "num_workers": to("num_workers"),
    "sharding_strategy": _sharding,
    "fsdp_activation_checkpointing": to("checkpoint_activations"),
    "selective_checkpointing": _every_kth_block,
    "mixed_precision": _mixed_precision,
    "low_cpu_fsdp": to("zero_init"),
    "batch_size": to("train_micro_batch_size_per_gpu"),
    "num_steps": to("train_iters"),
    "training_stage": _stage,
    "learning_rate": to("lr"),
    "grad_clip_thresh": to("gradient_clipping"),
    "seed": to("seed"),
    "resuming_dataset": _resuming_dataset,
    "use_profiler": _profiler,
    "profiler_rank0_only": _rank0_profiler,
    "report_interval": to("log_interval"),
    "checkpoint_interval": to("checkpoint_factor"),
    "tracker": _tracker,
    "tracker_dir": _tracker_dir,
    "tracker_project_name": _tracker,
    "tracker_run_id": _tracker,
    "use_torch_compile": to("compile_layers"),
}

_SPECULATOR = "speculator training (fms-fsdp's speculator/train_speculator.py) is not built here"
REFUSED: dict[str, str] = {
    "sep_token": "not a train_config field at fms-fsdp 5a296afe (documents end with eos_token)",
    **{key: _SPECULATOR for key in ("tp_size", "model_arch", "model_path", "n_speculator_heads", "speculator_width",
                                    "speculator_tie_weights", "speculator_scale_input", "stage2_start_step",
                                    "stage2_prompt_length", "stage2_batch_size", "stage2_seq_length")},
}

KEEP_WHOLE: frozenset[str] = frozenset()

FMS_DEFAULTS: dict[str, Any] = {
    "model_variant": "7b",
    "ckpt_load_path": "/fsx/output/ckpt",
    "ckpt_save_path": "/fsx/output/ckpt",
    "use_dummy_dataset": False,
    "data_path": "/fsx/data",
    "datasets": "lang=en/dataset=commoncrawl,lang=en/dataset=webhose,lang=en/dataset=github_clean,"
                "lang=de/dataset=wikipedia,lang=es/dataset=wikipedia,lang=fr/dataset=wikipedia,"
                "lang=ja/dataset=wikipedia,lang=pt/dataset=wikipedia,lang=en/dataset=wikimedia,"
                "lang=en/dataset=uspto,lang=en/dataset=pubmedcentral,lang=en/dataset=arxiv,"
                "lang=en/dataset=stackexchange",
    "weights": "7725,500,550,28,17,22,25,8,100,500,175,250,100",
    "file_type": "arrow",
    "seq_length": 4096,
    "eos_token": 0,
    "logical_shards": 1024,
    "num_workers": 1,
    "sharding_strategy": "hsdp",
    "mixed_precision": True,
    "batch_size": 2,
    "num_steps": 1_000_000,
    "training_stage": "initial",
    "learning_rate": 3e-4,
    "grad_clip_thresh": 1.0,
    "seed": 2023,
    "report_interval": 100,
    "checkpoint_interval": 10_000,
    "tracker_dir": "/fsx/aim_logs/llama",
    "use_torch_compile": True,
}
"""``train_config``'s defaults (fms_fsdp/config/training.py at 5a296afe) that set something here."""


def implied(translation: Translation, leaves: dict[str, Leaf], source: str) -> None:
    ctx = Context(leaves)
    variant = variant_name(ctx)
    where = leaves["model_variant"].where if "model_variant" in leaves else "fms-fsdp's default"
    translation.put(Leaf(f"model_variant={variant}", variant, where), MODEL_VARIANTS[variant], implied=True)
    for key, value in FMS_DEFAULTS.items():
        if key not in leaves and key not in ("model_variant", "tracker_dir", "data_path", "datasets", "weights"):
            rule = RULES[key]
            translation.put(Leaf(f"{key}={value}", value, "fms-fsdp's default"),
                            rule(value, Context({**leaves, key: Leaf(key, value, "default")})), implied=True)
    if not ctx.value("use_dummy_dataset", False) and not {"data_path", "datasets", "weights"} & set(leaves):
        translation.put(Leaf("data_path/datasets/weights", None, "fms-fsdp's default"), _datasets(ctx), implied=True)
    # main_training_llama.py: AdamW(lr, betas=(0.9, 0.95), weight_decay=0.1) over every parameter
    translation.put(Leaf("AdamW(betas=(0.9, 0.95), weight_decay=0.1)", None, "fms-fsdp"),
                    {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95], "eps": 1e-8}},
                     "weight_decay": 0.1}, implied=True)
    # fms-fsdp trains on token ids with no tokenizer: the ids are read as they are (byte-level
    # tokenizer, end-of-document id 0) over the variant's embedding rows (padded_vocab_size)
    translation.put(Leaf("token ids (no tokenizer)", None, "fms-fsdp"), {"tokenizer_type": "CharLevelTokenizer"},
                    implied=True)
    # fms-fsdp trains without gradient accumulation: the global batch is the micro batch x ranks
    translation.put(Leaf("batch_size (no accumulation)", None, "fms-fsdp"), {"gradient_accumulation_steps": 1},
                    implied=True)
