"""The model Levanter builds from a Hugging Face checkpoint's ``config.json``, as GPT-NeoX model keys.

``lora_lm.py`` and ``sft.py`` (with ``initialize_from_hf``), and ``train_lm.py`` with ``use_hf_model_config: true``,
take the model from the checkpoint, not from the YAML's ``model:`` section (stanford-crfm/levanter at 9263f81e:
``lora_lm.py:56,62`` ``converter.default_config``; ``sft.py:114-123`` the same with ``seq_len`` replaced by
``max_seq_len``; ``train_lm.py:93-96`` ``config.model = converter.config_from_hf_config(...)``). The converter's
``default_config`` is ``<LevConfig>.from_hf_config(AutoConfig of the directory)`` (``compat/hf_checkpoints.py:
424-462``), which reads only these fields (``LlamaConfig.from_hf_config``, ``models/llama.py:105-120``):
``max_position_embeddings`` (its ``seq_len``), ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``hidden_act``, ``initializer_range``, ``rms_norm_eps``,
``tie_word_embeddings`` and the rope (``rope_theta`` with ``rope_scaling``, ``layers/rotary.py:58-62``);
``MistralConfig.from_hf_config`` (``models/mistral.py:95-110``) reads the same but neither ``tie_word_embeddings``
nor ``rope_scaling``, and keeps ``sliding_window`` only for its exports. Every other field keeps Levanter's
default (no biases, head_dim = hidden / heads, no dropout, gradient checkpointing on): a ``config.json`` whose
value of such a field would make Levanter's model differ from the checkpoint's is refused by name.

The directory is read as plain JSON before launch (``megatron/interop/hf_keys.py``, the HF import's own
mapping); nothing is downloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from megatron.errors import ConversionError
from megatron.interop.hf_keys import neox_model_keys, read_config_json, rope_fields
from megatron.neox_arguments.dialects.common import Refused

LEVANTER_TYPES = {"llama": "llama", "mistral": "mistral", "olmo2": "olmo2", "gemma": "gemma"}
"""HF ``model_type`` -> the Levanter model type whose HF config class it is (``HFCheckpointConverter.from_hf``,
hf_checkpoints.py:327-349), among those Deepy builds."""
_ROPE_SCALINGS = ("linear", "llama3")
"""HF rope scalings Levanter reads as Deepy builds them (rotary.py:93-94,183); its yarn is not HF's."""
_NOT_PASSED = ("padded_vocab_size", "attention_dropout", "sliding_window_width")
"""Keys of the HF mapping Levanter does not take from config.json: the vocabulary is the tokenizer's, Llama has
no dropout, and Mistral's sliding window is only written into exports (its attention is full causal)."""


@dataclass(frozen=True)
class HfShape:
    """The model a Levanter entry point builds from ``directory``'s config.json."""

    directory: str
    kind: str
    """Levanter's model type: llama or mistral."""
    keys: dict[str, Any]
    """GPT-NeoX model keys, Levanter's seq_len (max_position_embeddings) as seq_length."""

    @property
    def config_json(self) -> str:
        return os.path.join(self.directory, "config.json")

    @property
    def tied(self) -> bool:
        return not self.keys["no_weight_tying"]


def _refuse_unread(cfg: dict[str, Any], kind: str) -> None:
    """Fields Levanter does not read but whose value would make its model differ from the checkpoint's."""
    # Olmo2Config.from_hf_config reads attention_bias and attention_dropout (olmo.py:108-126)
    read = ("attention_bias", "attention_dropout") if kind == "olmo2" else ()
    problems = [f"{name}: {cfg[name]!r} (Levanter builds no biases: use_bias defaults to False and from_hf_config "
                f"does not read it, llama.py:105-120)" for name in ("attention_bias", "mlp_bias")
                if cfg.get(name) and name not in read]
    if cfg.get("attention_dropout") and "attention_dropout" not in read:
        problems.append(f"attention_dropout: {cfg['attention_dropout']!r} (Levanter's {kind} has no dropout)")
    _, _, scaling = rope_fields(cfg)
    if scaling is not None:
        scale_type = scaling.get("rope_type") or scaling.get("type")
        if kind == "mistral":
            problems.append(f"rope scaling {scaling!r} (MistralConfig.from_hf_config passes none, mistral.py:97)")
        elif scale_type not in _ROPE_SCALINGS:
            problems.append(f"rope scaling type {scale_type!r} (Levanter's {scale_type} rope is not transformers'; "
                            f"Deepy builds {', '.join(_ROPE_SCALINGS)} as both do)")
    if kind == "mistral" and cfg.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings: true (MistralConfig.from_hf_config does not read it: Levanter's "
                        "Mistral is untied, mistral.py:95-110)")
    if problems:
        raise Refused("Levanter's model would differ from the checkpoint's: " + "; ".join(problems))


@lru_cache(maxsize=32)
def _shape(directory: str, stamp: tuple[int, int]) -> HfShape:
    cfg = read_config_json(directory)
    kind = LEVANTER_TYPES.get(str(cfg.get("model_type")))
    if kind is None:
        raise Refused(f"model_type {cfg.get('model_type')!r} in {directory}/config.json: Deepy builds Levanter's "
                      f"HF-compatible {', '.join(LEVANTER_TYPES)} models")
    _refuse_unread(cfg, kind)
    try:
        keys = neox_model_keys(cfg)
    except ConversionError as err:
        raise Refused(f"{directory}/config.json: {err}") from None
    passed = {"attention_dropout"} if kind == "olmo2" else set()
    if kind == "gemma":  # GemmaConfig.from_hf_config always takes gelu_new, whatever the config says (gemma.py:133-150)
        keys["activation"] = "geglu_tanh"
    return HfShape(directory, kind, {k: v for k, v in keys.items() if k not in _NOT_PASSED or k in passed})


def hf_shape(directory: str) -> HfShape:
    """What Levanter builds from ``directory``'s config.json (read again when the file changes)."""
    path = os.path.join(directory, "config.json")
    st = os.stat(path)
    return _shape(directory, (st.st_mtime_ns, st.st_size))


__all__ = ["HfShape", "LEVANTER_TYPES", "hf_shape"]
