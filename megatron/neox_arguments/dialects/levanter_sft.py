"""Levanter's other training entry points: ``sft.py`` (``SFTConfig``) and ``lora_lm.py`` (``LoraLmConfig``).

Read from stanford-crfm/levanter at 9263f81e (``src/levanter/main/sft.py``, ``src/levanter/main/lora_lm.py``,
``src/levanter/lora.py``, ``src/levanter/data/text.py``, ``src/levanter/data/packing.py``). A config is one of
them when it holds a key only that entry point has (:data:`SFT_KEYS`, :data:`LORA_KEYS`); its ``model``,
``trainer`` and ``optimizer`` sections are read as train_lm's are.

SFT data (``dataset_type: chat_jsonl``): sft.py reads the first ``input_role`` message and the first
``output_role`` message of each line, joins them without a template and trains on every token after the
prompt's. Deepy's train.py reads that as an SFT dataset (``train_data_paths`` + ``train_label_data_paths``)
written by ``tools/datasets/preprocess_data_with_mask.py --single-turn``, which encodes exactly so; deepy.py
runs it once before launch (a :class:`PrepareStep` of the translation) into ``supervised_data.cache_dir``,
named by a hash of what the tokens depend on, so a changed input is converted afresh.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any

from megatron.neox_arguments.dialects import hf_hub
from megatron.neox_arguments.dialects.common import Context, Leaf, PrepareStep, Refused, Rule, Translation, noted
from megatron.neox_arguments.dialects.levanter_hf_model import HfShape, hf_shape
from megatron.neox_arguments.dialects.levanter_trainer import run_id

SFT_DEFAULT_MODEL = "NousResearch/Llama-2-7b-hf"
"""sft.py:73-74@9263f81e: the default model_name_or_path and tokenizer (hub names: refused here)."""
SFT_DEFAULTS: dict[str, Any] = {"max_seq_len": 2048, "dataset_type": "chat_jsonl", "messages_field": "messages",
                                "input_role": "user", "output_role": "assistant"}
"""SFTConfig's defaults (sft.py:72-81@9263f81e)."""
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 8.0, "dropout": 0.0, "target_modules": None}
"""LoraConfig's defaults (lora.py:94-99@9263f81e)."""

SFT_KEYS = frozenset({"dataset_type", "supervised_data", "chat_train_urls", "max_seq_len", "model_name_or_path",
                      "messages_field", "input_role", "output_role", "reinit_tokens", "reinit_lm_head",
                      "reinit_embeddings", "tokenizer"})
"""Top-level keys only sft.py's SFTConfig has (sft.py:57-96@9263f81e)."""
LORA_KEYS = frozenset({"lora", "peft_save_path", "peft_hf_upload", "merged_hf_save_path", "merged_hf_upload",
                       "trust_remote_code", "max_train_length"})
"""Top-level keys only lora_lm.py's LoraLmConfig has (lora_lm.py:33-49@9263f81e)."""

KEEP_WHOLE = frozenset({"supervised_data"})
"""Mappings read as a whole by their rule."""
CONVERT_TOOL = "tools/datasets/preprocess_data_with_mask.py"


def is_sft(ctx: Context) -> bool:
    """An sft.py config: it holds a key only SFTConfig has (the top-level tokenizer alone does not tell: Levanter's
    exporter, export_lm_to_hf.py, has it too)."""
    return any(path.split(".")[0] in SFT_KEYS - {"tokenizer"} for path in ctx.leaves)


def is_lora(ctx: Context) -> bool:
    return any(path.split(".")[0] in LORA_KEYS for path in ctx.leaves)


def length_owner(ctx: Context) -> str | None:
    """The entry point's key that sets the trained sequence length instead of model.seq_len, if any:
    sft.py's max_seq_len with initialize_from_hf (sft.py:123), lora_lm.py's max_train_length (lora_lm.py:74-77)."""
    if is_sft(ctx) and ctx.value("initialize_from_hf"):
        return "max_seq_len"
    if is_lora(ctx) and ctx.value("max_train_length") is not None:
        return "max_train_length"
    return None


def hf_model_source(ctx: Context) -> tuple[str, str] | None:
    """The local HF directory whose config.json gives this run's model, and the Levanter lines that say so; None
    where the model: section gives it (``initialize_from_hf``'s own rule refuses a source that is not local)."""
    value = ctx.value("initialize_from_hf")
    if not value:
        return None
    if is_lora(ctx):
        source, why = value, "lora_lm.py:56,62"
    elif is_sft(ctx):
        source, why = (hf_source(ctx) if value is True else value), "sft.py:114-123"
    elif ctx.value("use_hf_model_config"):
        source, why = (reference_checkpoint(ctx) if value is True else value), "train_lm.py:93-96"
    else:
        return None
    if not isinstance(source, str):
        return None
    try:  # a hub name cached here reads as its snapshot directory
        return hf_hub.local_dir(source, "config.json", "model directory"), why
    except Refused:
        return None


def hf_model(ctx: Context) -> HfShape | None:
    """The model Levanter builds from the HF checkpoint's config.json for this config, if it does."""
    found = hf_model_source(ctx)
    return None if found is None else hf_shape(found[0])


def _value(ctx: Context, key: str) -> Any:
    return ctx.value(key, SFT_DEFAULTS.get(key))


# ----------------------------------------------------------------------------------------- sft.py


def _supervised_sources(value: Any) -> list[dict[str, Any]]:
    """supervised_data: one source, or a mapping name -> source (sft.py:64)."""
    if not isinstance(value, dict):
        raise Refused("a source (cache_dir, train_urls) or a mapping of named sources")
    if any(isinstance(v, dict) for v in value.values()):
        return [dict(v or {}) for v in value.values()]
    return [dict(value)]


def _supervised_data(value: Any, ctx: Context) -> dict[str, Any]:
    sources = _supervised_sources(value)
    if any("id" in s for s in sources):
        raise Refused("a Hugging Face dataset id would be downloaded; give local chat jsonl in chat_train_urls")
    if _value(ctx, "dataset_type") != "chat_jsonl":
        return {}  # dataset_type's own rule refuses it
    if not sources[0].get("cache_dir"):
        raise Refused("sft.py reads its cache_dir (the first source's, sft.py:155-159); give one")
    return noted("sft.py reads only the first source's cache_dir (sft.py:155-159): the converted chat data goes there; "
                 "its train_urls are not read with dataset_type chat_jsonl (chat_train_urls are)")


def _tokenizer_file(ctx: Context, check: bool = True) -> str:
    """sft.py's tokenizer: a tokenizer.json, its directory, or a hub name cached on this machine (``hf_hub.py``)."""
    path = str(ctx.value("tokenizer", SFT_DEFAULT_MODEL))
    if os.path.isfile(path):
        return path
    try:
        return os.path.join(hf_hub.local_dir(path, "tokenizer.json", "tokenizer.json or its directory"),
                            "tokenizer.json")
    except Refused as err:
        if not check:
            return os.path.join(path, "tokenizer.json")
        raise Refused(f"the tokenizer (sft.py's top-level tokenizer key): {err}") from None


def _tokenizer(value: Any, ctx: Context) -> dict[str, Any]:
    if not is_sft(ctx):
        raise Refused("a key of Levanter's sft.py and of its exporter (export_lm_to_hf.py); beside no other sft.py key "
                      "(chat_train_urls, supervised_data, ...) this file is not an sft.py config; train_lm reads "
                      "data.tokenizer, and a Deepy checkpoint is exported with tools/ckpts/convert_neox_to_hf.py")
    return {"tokenizer_type": "HFTokenizer", "vocab_file": _tokenizer_file(ctx)}


def chat_urls(value: Any) -> list[str]:
    """chat_train_urls as local files: a pattern globbed (``**`` too), as Levanter's fsspec expands them; a plain
    path as it is (:func:`check_converted` requires it to exist)."""
    found: list[str] = []
    for pattern in [value] if isinstance(value, str) else list(value or []):
        pattern = str(pattern)
        found += sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    return found


def converted_prefix(ctx: Context, urls: list[str], tokenizer: str) -> str:
    """Where the converted SFT dataset of this config lives: ``<cache_dir>/levanter_sft_<hash>``, the hash
    of everything its tokens depend on."""
    cache_dir = str(_supervised_sources(ctx.value("supervised_data"))[0]["cache_dir"])
    spec = {"urls": [os.path.abspath(u) for u in urls], "tokenizer": os.path.abspath(tokenizer),
            **{k: _value(ctx, k) for k in ("messages_field", "input_role", "output_role", "max_seq_len")}}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(cache_dir, f"levanter_sft_{digest}")


def convert_argv(ctx: Context, urls: list[str], tokenizer: str, prefix: str) -> tuple[str, ...]:
    """The tool and arguments that write the SFT dataset of this config (Deepy's own data tool)."""
    return (CONVERT_TOOL, "--single-turn", "--input", ",".join(urls), "--output-prefix", prefix, "--mode", "sft",
            "--tokenizer-type", "HFTokenizer", "--vocab-file", tokenizer, "--messages-key", str(_value(ctx, "messages_field")),
            "--input-role", str(_value(ctx, "input_role")), "--output-role", str(_value(ctx, "output_role")),
            "--max-length", str(_value(ctx, "max_seq_len")))


def _chat_train_urls(value: Any, ctx: Context) -> dict[str, Any]:
    if _value(ctx, "dataset_type") != "chat_jsonl":
        return noted("read only with dataset_type chat_jsonl")
    if ctx.value("supervised_data") is None:
        raise Refused("sft.py asserts supervised_data is set (sft.py:152): its cache_dir holds the tokenized chats")
    prefix = converted_prefix(ctx, chat_urls(value), _tokenizer_file(ctx, check=False))
    # packing.py:128-157: whole conversations fill a sequence until the next would overflow it
    return {"train_data_paths": [f"{prefix}_text_document"], "train_label_data_paths": [f"{prefix}_label_document"],
            "pack_impl": "pack_until_overflow"}


def check_converted(ctx: Context, translation: Translation) -> None:
    """The chats and tokenizer are local files; their conversion, unless done, is a step deepy.py runs before
    launch (the converted files' name holds a hash of what they depend on, so a changed input converts afresh)."""
    urls = chat_urls(ctx.value("chat_train_urls"))
    missing = [u for u in urls if not os.path.isfile(u)]
    if not urls or missing:
        raise Refused(f"chat_train_urls: {missing[0] if missing else ctx.value('chat_train_urls')!r} matches no "
                      f"local file")
    tokenizer = _tokenizer_file(ctx)
    prefix = converted_prefix(ctx, urls, tokenizer)
    if not os.path.isfile(f"{prefix}_label_document.idx"):
        translation.prepare.append(PrepareStep(convert_argv(ctx, urls, tokenizer, prefix), f"{prefix}_label_document.idx",
                                               "sft.py's chat_train_urls, tokenized as sft.py does"))


def _dataset_type(value: Any, ctx: Context) -> dict[str, Any]:
    if value == "chat_jsonl":
        return noted("chat jsonl: chat_train_urls, converted by deepy.py before launch")
    raise Refused("Deepy reads sft.py's chat_jsonl data (chat_train_urls); the huggingface type reads a hub dataset")


def _max_seq_len(value: Any, ctx: Context) -> dict[str, Any]:
    # sft.py:100-105,123: the tokenizer truncates at max_seq_len; with initialize_from_hf it is also the model's
    if ctx.value("initialize_from_hf"):
        return {"seq_length": int(value), "max_position_embeddings": int(value)}
    return noted("the tokenizer truncates each conversation there (the converter's --max-length)")


LLAMA3_REINIT_TOKENS = ["<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                        "<|eot_id|>"]
"""What ``reinit_tokens: true`` re-draws (sft.py:250-258@9263f81e, "hardcoded to llama3")."""


def _reinit_tokens(value: Any, ctx: Context) -> dict[str, Any]:
    # sft.py:232-274: at step 0 only (a resumed run or trainer.initialize_from's continued run keeps its rows)
    if not value:
        return noted("off (an empty list too: sft.py:247 tests its truth)")
    if value is True:
        return {"reinit_tokens": list(LLAMA3_REINIT_TOKENS)}
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise Refused("a list of token strings, or true for llama3's five chat tokens (sft.py:88)")
    return {"reinit_tokens": list(value)}


def _reinit_flag(key: str) -> Rule:
    """reinit_lm_head / reinit_embeddings (sft.py:93-96): read only when reinit_tokens is set."""
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if not ctx.value("reinit_tokens"):
            return noted("read only with reinit_tokens")
        return {key: bool(value)}
    return rule


def _model_name_or_path(value: Any, ctx: Context) -> dict[str, Any]:
    if ctx.value("initialize_from_hf") is True:
        return noted("the model initialize_from_hf: true reads (sft.py:114)")
    return noted("read by sft.py only with initialize_from_hf (sft.py:114) or hf_save_steps (sft.py:127-128)")


def hf_source(ctx: Context) -> Any:
    """What ``initialize_from_hf: true`` reads: sft.py's model_name_or_path (sft.py:114)."""
    return ctx.value("model_name_or_path", SFT_DEFAULT_MODEL)


REFERENCE_CHECKPOINTS: dict[str, str] = {
    "llama": "NousResearch/Llama-2-7b-hf",  # models/llama.py:80@9263f81e
    "mistral": "mistralai/Mistral-7B-v0.1",  # models/mistral.py:84
    "mixtral": "mistralai/Mixtral-8x7B-v0.1",  # models/mixtral.py:96
    "gpt2": "gpt2",  # models/gpt2.py:80
    "gemma": "google/gemma-2b",  # models/gemma.py:124
    "olmo2": "allenai/OLMo-2-1124-7B",  # models/olmo.py:79
}
"""The hub repo each model type's ``hf_checkpoint_converter`` reads where ``model.reference_checkpoint`` is not given
(Levanter's defaults): what train_lm's ``initialize_from_hf: true`` starts from (train_lm.py:84-90). Qwen's and Qwen3's
configs inherit LlamaConfig's (qwen.py:37,301), a Llama checkpoint: not taken here (give model.reference_checkpoint)."""


def raw_model_type(ctx: Context) -> str:
    """``model.type`` as written (LlamaConfig where absent: train_lm.py's default model), built here or not."""
    return str(ctx.value("model.type", "llama")).lower()


def reference_checkpoint(ctx: Context) -> str | None:
    """``model.reference_checkpoint``, else Levanter's default for the model type (None where none is known here)."""
    given = ctx.value("model.reference_checkpoint")
    return str(given) if given is not None else REFERENCE_CHECKPOINTS.get(raw_model_type(ctx))


_MIXTURE = ("not a field of Levanter's SFTConfig (sft.py:57-96@9263f81e), so Levanter's own sft.py refuses this "
            "file; blend converted datasets with GPT-NeoX's train_data_paths/train_data_weights")
SFT_RULES: dict[str, Rule] = {
    "dataset_type": _dataset_type,
    "supervised_data": _supervised_data,
    "chat_train_urls": _chat_train_urls,
    "max_seq_len": _max_seq_len,
    "model_name_or_path": _model_name_or_path,
    "tokenizer": _tokenizer,
    "messages_field": lambda v, ctx: noted("the converter's --messages-key"),
    "input_role": lambda v, ctx: noted("the converter's --input-role: the prompt, no loss"),
    "output_role": lambda v, ctx: noted("the converter's --output-role: the completion, trained on"),
    "reinit_tokens": _reinit_tokens,
    "reinit_lm_head": _reinit_flag("reinit_lm_head"),
    "reinit_embeddings": _reinit_flag("reinit_embeddings"),
}
SFT_REFUSED: dict[str, str] = {"mixture_weights": _MIXTURE, "mixture_block_size": _MIXTURE, "stop_strategy": _MIXTURE}

# ------------------------------------------------------------------------------------- lora_lm.py

# lora.py:95-109@9263f81e: every hnn.Linear whose key path ends with a target name is adapted (target_modules null:
# every one), each with its own LowRankLinear. Deepy's adapters sit on GPT-NeoX's projections; a Levanter name maps
# onto the projection holding the same matrix. GPT-2's c_attn is itself the fused q/k/v projection (one Linear,
# gpt2.py:172), as query_key_value is; c_proj ends both the attention's and the MLP's output projections. A Llama's
# q/k/v and gate/up are separate Linears (llama.py:264-266, and its attention's q_proj..o_proj), which Deepy fuses:
# lora_split_fused gives each section its own adapter. lm_head is a Linear only when the head is untied
# (llama.py:500-503; a tied head is the embedding, an hnn.Embedding, never adapted).
LORA_TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"c_attn": ("query_key_value",), "c_proj": ("dense", "dense_4h_to_h"), "c_fc": ("dense_h_to_4h",)},
    "llama": {"q_proj": ("query_key_value",), "k_proj": ("query_key_value",), "v_proj": ("query_key_value",),
              "o_proj": ("dense",), "gate_proj": ("dense_h_to_4h",), "up_proj": ("dense_h_to_4h",),
              "down_proj": ("dense_4h_to_h",), "lm_head": ("output_layer",)},
}
_SECTIONS = {"query_key_value": ("q_proj", "k_proj", "v_proj"), "dense_h_to_4h": ("gate_proj", "up_proj")}
"""Deepy's fused projections of a Llama and the Levanter modules that are their sections, in order."""


def model_kind(ctx: Context) -> str:
    """The Levanter model type trained: config.json's where the HF checkpoint gives the model, else model.type."""
    shape = hf_model(ctx)
    return shape.kind if shape is not None else str(ctx.value("model.type", "llama")).lower()


def _tied_head(ctx: Context, kind: str) -> bool:
    """GPT-2 always ties (gpt2.py); llama/mistral's tie_word_embeddings defaults to False (llama.py:64)."""
    shape = hf_model(ctx)
    if shape is not None:
        return shape.tied
    return kind == "gpt2" or bool(ctx.value("model.tie_word_embeddings", False))


def _lora_targets(value: Any, ctx: Context) -> dict[str, Any]:
    kind = "gpt2" if model_kind(ctx) == "gpt2" else "llama"
    table = LORA_TARGETS[kind]
    tied = _tied_head(ctx, kind)
    if isinstance(value, str):
        raise Refused(f"a regular expression of module paths is not mapped; list target_modules among {sorted(table)}")
    names = [n for n in table if not (tied and n == "lm_head")] if value is None else list(value)
    targets: list[str] = []
    for name in names:
        if name not in table:
            raise Refused(f"{name!r} names no linear layer of a {kind} model here; map-able: {sorted(table)}")
        if name == "lm_head" and tied:
            raise Refused("lm_head with a tied head (model.tie_word_embeddings): Levanter's tied model has no lm_head "
                          "Linear (llama.py:500-501), so nothing would be adapted; remove lm_head")
        targets += [t for t in table[name] if t not in targets]
    if kind == "gpt2":
        return {"lora_target_modules": targets}
    for fused, sections in _SECTIONS.items():
        missing = [s for s in sections if s not in names]
        if fused in targets and missing:
            raise Refused(f"{[s for s in sections if s in names]} without {missing}: Deepy fuses {', '.join(sections)} "
                          f"into {fused}, whose sections get their adapters together; list all of them")
    return {"lora_target_modules": targets, "lora_split_fused": any(t in _SECTIONS for t in targets)}


def _lora_r(value: Any, ctx: Context) -> dict[str, Any]:
    if int(value) <= 0:
        raise Refused("a LoRA rank must be positive")
    # lora.py:148-152: both factors drawn with haliax's Linear.init (truncated normal / sqrt(fan in))
    return {"lora_r": int(value), "lora_init": "levanter"}


def _null_export(what: str) -> Rule:
    return lambda v, ctx: noted("unset") if not v else _refuse(f"{what} while training is not built; export a "
                                                                 f"checkpoint with tools/ckpts/convert_neox_to_hf.py")


def _refuse(reason: str) -> dict[str, Any]:
    raise Refused(reason)


PEFT_NAMES = {"llama": "llama", "mistral": "llama"}
"""Levanter model types whose transformers class names the adapters as Llama does (model.layers.N.self_attn.o_proj)."""


def _peft_save_path(value: Any, ctx: Context) -> dict[str, Any]:
    """lora_lm.py:151-158: PEFT adapters into ``<peft_save_path>/<run id>/step-<step>`` every hf_save_steps."""
    if not value:
        return noted("unset")
    kind = model_kind(ctx)
    if kind not in PEFT_NAMES:
        raise Refused(f"saving PEFT adapters of a {kind} model is not built (llama and mistral are); export a "
                      "checkpoint with tools/ckpts/convert_neox_to_hf.py")
    return {"lora_peft_save_path": os.path.join(str(value), run_id(ctx)), "lora_peft_names": PEFT_NAMES[kind]}


LORA_RULES: dict[str, Rule] = {
    "lora.r": _lora_r,
    "lora.alpha": lambda v, ctx: {"lora_alpha": float(v)},
    "lora.dropout": lambda v, ctx: {"lora_dropout": float(v)},
    "lora.target_modules": _lora_targets,
    # lora_lm.py:74-77: the sequence length trained on
    "max_train_length": lambda v, ctx: {"seq_length": int(v)} if v is not None else noted("the model's length"),
    "peft_save_path": _peft_save_path,
    "peft_hf_upload": _null_export("uploading PEFT adapters"),
    "merged_hf_save_path": _null_export("saving merged HF checkpoints"),
    "merged_hf_upload": _null_export("uploading merged HF checkpoints"),
    "trust_remote_code": lambda v, ctx: noted("no remote code runs here") if not v
    else _refuse("running a model repository's own code is not built"),
}


def sft_structure(ctx: Context) -> None:
    """What sft.py requires of a config as a whole (checked before its data are looked for)."""
    if any(path.startswith("data.") for path in ctx.leaves):
        raise Refused("sft.py's SFTConfig has no data section: its data are chat_train_urls and supervised_data")
    if not ctx.value("initialize_from_hf") and not ctx.value("trainer.initialize_from"):
        raise Refused("sft.py starts from a model: give initialize_from_hf or trainer.initialize_from "
                      "(sft.py:124-125 raises 'Must specify either --initialize_from_hf or --initialize_from')")
    if _value(ctx, "dataset_type") == "chat_jsonl" and "chat_train_urls" not in ctx.leaves:
        raise Refused("sft.py's chat_jsonl data are chat_train_urls (it asserts them, sft.py:151); give local "
                      "chat jsonl files")
    if "tokenizer" not in ctx.leaves:
        raise Refused(f"sft.py's tokenizer defaults to the hub name {SFT_DEFAULT_MODEL!r} (sft.py:74), which "
                      f"would be downloaded; give a local tokenizer directory")


def implied(translation: Translation, leaves: dict[str, Leaf]) -> None:
    """What sft.py and lora_lm.py require or imply beyond their keys' rules."""
    ctx = Context(leaves)
    sft, lora = is_sft(ctx), is_lora(ctx)
    if sft and lora:
        raise Refused("this config holds keys of both sft.py and lora_lm.py; a run uses one entry point")
    if sft:
        sft_structure(ctx)
        if _value(ctx, "dataset_type") == "chat_jsonl":
            check_converted(ctx, translation)
        if "max_seq_len" not in leaves and ctx.value("initialize_from_hf"):
            value = SFT_DEFAULTS["max_seq_len"]
            translation.put(Leaf(f"max_seq_len={value}", value, "Levanter's default (sft.py:72)"),
                            _max_seq_len(value, ctx), implied=True)
    if lora:
        if not ctx.value("initialize_from_hf"):
            raise Refused("lora_lm.py adapts a model initialize_from_hf names (a required field, lora_lm.py:35)")
        for key, value in LORA_DEFAULTS.items():
            path = f"lora.{key}"
            if path not in leaves:
                default = Leaf(path, value, "Levanter's default")
                translation.put(Leaf(f"{path}={value}", value, "Levanter's default (lora.py:94-99)"),
                                LORA_RULES[path](value, Context({**leaves, path: default})), implied=True)


__all__ = ["LORA_KEYS", "LORA_RULES", "SFT_KEYS", "SFT_REFUSED", "SFT_RULES", "hf_source", "implied", "is_sft"]
