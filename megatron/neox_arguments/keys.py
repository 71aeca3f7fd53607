"""Argument names as users write them: ``-``/``_`` spellings and "did you mean" suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from megatron.data.config import PATH_KEYS


def _singular_aliases() -> dict[str, str]:
    return {key.removesuffix("s"): key for key in PATH_KEYS}


SINGULAR_ALIASES: dict[str, str] = _singular_aliases()
"""GPT-NeoX's configuration guide writes the per-split data keys in the singular
(``train_data_path``, ``pos_valid_label_data_path``) while its argument list has the plural lists;
the singular spelling is a one-path form of the plural key."""


def normalize_key(key: str) -> str:
    """GPT-NeoX configs write ``train-iters`` and ``train_iters`` alike; both mean the same argument,
    and a singular data key (``train_data_path``) means its plural list (``train_data_paths``)."""
    key = key.replace("-", "_")
    return SINGULAR_ALIASES.get(key, key)


def aliased_value(raw_key: str, value: object) -> object:
    """The value a key written as ``raw_key`` stands for: one path becomes a one-item list when the
    key is a singular alias of a list key."""
    if raw_key.replace("-", "_") in SINGULAR_ALIASES and isinstance(value, str):
        return [value]
    return value


def close_matches(key: str, names: Iterable[str], limit: int = 3) -> list[str]:
    return difflib.get_close_matches(normalize_key(key), list(names), n=limit, cutoff=0.6)


def unknown_key_message(key: str, where: str, names: Iterable[str]) -> str:
    """``unknown key 'hiden_size' at configs/x.yml:3; did you mean: hidden_size?``; another trainer's name for a key
    (``learning_rate``) is answered by meaning (:data:`OTHER_TRAINERS_NAMES`)."""
    by_meaning = meaning_hint(key)
    matches = close_matches(key, names)
    if by_meaning is not None:
        hint = f"; {by_meaning}"
    elif matches:
        hint = f"; did you mean: {', '.join(matches)}?"
    else:
        hint = "; see configs/neox_arguments.md for the valid keys"
    return f"unknown key '{key}' at {where}{hint}"


OTHER_TRAINERS_NAMES: dict[str, tuple[str, str, str]] = {
    # Hugging Face's TrainingArguments (and TRL's)
    "learning_rate": ("lr", "Hugging Face's, Levanter's and fms-fsdp's", "the peak learning rate"),
    "per_device_train_batch_size": ("train_micro_batch_size_per_gpu", "Hugging Face's",
                                    "samples per forward/backward on one data-parallel rank"),
    "num_train_epochs": ("train_epochs", "Hugging Face's", "passes over the data, instead of train_iters"),
    "max_steps": ("train_iters", "Hugging Face's", "the number of optimizer steps"),
    "warmup_steps": ("warmup", "Hugging Face's", "a fraction of lr_decay_iters (GPT-NeoX's meaning), or a whole "
                                                 "number above 1 of steps"),
    "warmup_ratio": ("warmup", "Hugging Face's", "a fraction of lr_decay_iters (the decay steps)"),
    "lr_scheduler_type": ("lr_decay_style", "Hugging Face's", "the schedule's shape (cosine decays onto min_lr)"),
    "max_grad_norm": ("gradient_clipping", "Hugging Face's and Levanter's", "the global gradient-norm clip"),
    "adam_beta1": ("optimizer.params.betas", "Hugging Face's", "[beta1, beta2] in the optimizer block"),
    "adam_beta2": ("optimizer.params.betas", "Hugging Face's", "[beta1, beta2] in the optimizer block"),
    "adam_epsilon": ("optimizer.params.eps", "Hugging Face's", "Adam's epsilon in the optimizer block"),
    "logging_steps": ("log_interval", "Hugging Face's", "log every this many steps"),
    "save_steps": ("checkpoint_factor", "Hugging Face's", "save every this many steps (checkpoint_scale linear)"),
    "eval_steps": ("eval_interval", "Hugging Face's", "evaluate every this many steps"),
    "output_dir": ("save", "Hugging Face's", "the checkpoints' directory (log_dir: the logs')"),
    "resume_from_checkpoint": ("load", "Hugging Face's", "the directory whose latest checkpoint is loaded"),
    "gradient_checkpointing": ("checkpoint_activations", "Hugging Face's", "recompute activations in the backward"),
    "dataloader_num_workers": ("num_workers", "Hugging Face's", "batches read ahead"),
    "run_name": ("wandb_run_name", "Hugging Face's", "the run's name in W&B"),
    "report_to": ("tracker", "Hugging Face's", "[{type: wandb}, {type: tensorboard}], or use_wandb: true"),
    "max_seq_length": ("seq_length", "TRL's", "tokens in one training sample"),
    # Levanter's nested keys written flat
    "num_train_steps": ("train_iters", "Levanter's", "the number of optimizer steps"),
    "seq_len": ("seq_length", "Levanter's", "tokens in one training sample"),
    "max_seq_len": ("seq_length", "Levanter's", "tokens in one training sample"),
    "steps_per_eval": ("eval_interval", "Levanter's", "evaluate every this many steps"),
    "max_eval_batches": ("eval_iters", "Levanter's", "batches per evaluation"),
    "lr_schedule": ("lr_decay_style", "Levanter's", "the schedule's shape"),
    "hidden_dim": ("hidden_size", "Levanter's", "the width of the residual stream"),
    "num_heads": ("num_attention_heads", "Levanter's", "query heads per attention layer"),
    "model_axis_size": ("model_parallel_size", "Levanter's", "the tensor-parallel degree"),
    # Megatron-LM's
    "micro_batch_size": ("train_micro_batch_size_per_gpu", "Megatron-LM's",
                         "samples per forward/backward on one data-parallel rank"),
    "global_batch_size": ("train_batch_size", "Megatron-LM's", "samples per optimizer step, over all ranks"),
    "lr_warmup_iters": ("warmup", "Megatron-LM's", "a fraction of lr_decay_iters, or a whole number above 1 of "
                                                   "steps"),
    "lr_warmup_fraction": ("warmup", "Megatron-LM's", "a fraction of lr_decay_iters"),
    "tensor_model_parallel_size": ("model_parallel_size", "Megatron-LM's", "the tensor-parallel degree"),
    "pipeline_model_parallel_size": ("pipe_parallel_size", "Megatron-LM's", "the number of pipeline stages"),
    "num_query_groups": ("num_kv_heads", "Megatron-LM's", "key/value heads of grouped-query attention"),
    "ffn_hidden_size": ("intermediate_size", "Megatron-LM's", "GPT-NeoX's MLP size (a gated MLP's halves are 2/3 of "
                                                              "it: docs/gpt_neox_semantics.md)"),
    "recompute_activations": ("checkpoint_activations", "Megatron-LM's", "recompute activations in the backward"),
    # nanoGPT's
    "max_iters": ("train_iters", "nanoGPT's", "the number of optimizer steps"),
    "warmup_iters": ("warmup", "nanoGPT's", "a fraction of lr_decay_iters, or a whole number above 1 of steps"),
    "grad_clip": ("gradient_clipping", "nanoGPT's", "the global gradient-norm clip"),
    "n_layer": ("num_layers", "nanoGPT's and GPT-2's", "the number of blocks"),
    "n_head": ("num_attention_heads", "nanoGPT's and GPT-2's", "query heads per attention layer"),
    "n_embd": ("hidden_size", "nanoGPT's and GPT-2's", "the width of the residual stream"),
    "block_size": ("seq_length", "nanoGPT's", "tokens in one training sample"),
    "dropout": ("hidden_dropout", "nanoGPT's", "dropout before the residual (attention_dropout: on the attention "
                                               "probabilities)"),
    "out_dir": ("save", "nanoGPT's", "the checkpoints' directory"),
    # transformers' model configs
    "num_hidden_layers": ("num_layers", "transformers'", "the number of blocks"),
    "num_key_value_heads": ("num_kv_heads", "transformers'", "key/value heads of grouped-query attention"),
    "rope_theta": ("rotary_emb_base", "transformers'", "the rotary base"),
    "rms_norm_eps": ("rms_norm_epsilon", "transformers'", "RMSNorm's epsilon"),
    "layer_norm_eps": ("layernorm_epsilon", "transformers'", "LayerNorm's epsilon"),
    "tie_word_embeddings": ("no_weight_tying", "transformers'", "the opposite switch: no_weight_tying: true unties"),
}
"""Keys other trainers name differently -> (Deepy's key, whose name it is, what Deepy's key means): an unknown key
found here is answered by meaning ("did you mean: lr?"), not by spelling ("sharding_strategy?"). Names that are
Deepy keys already (weight_decay, gradient_accumulation_steps, seed, warmup, eval_iters, ...) are not listed."""


def meaning_hint(key: str) -> str | None:
    """``did you mean: lr? ('learning_rate' is Hugging Face's ... name for it: the peak learning rate)``."""
    found = OTHER_TRAINERS_NAMES.get(normalize_key(key))
    if found is None:
        return None
    ours, whose, means = found
    return f"did you mean: {ours}? ('{key}' is {whose} name for it: {means})"
