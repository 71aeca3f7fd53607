"""A GPT-NeoX (DeeperSpeed) checkpoint directory read into full weights under our names (the offline
converter, ``tools/ckpts/convert_hf_to_neox.py``; ``load:`` reads the same files in ``load.py``).

The files are read by ``checkpointing/neox/files.py`` (every layout fact, of GPT-NeoX's current and
mid-2024 eras, is in ``checkpointing/neox/layout.py`` and docs/checkpoint_format.md). Here: the
architecture, from the run's GPT-NeoX config (``configs/`` or ``--config``) and the tensors' shapes
(hidden size, vocabulary, MLP width, biases, an untied head), and the refusal of what Deepy's model
does not compute the same way, each with its key named. A grouped-query model needs
``--neox-qkv-order`` (its files cannot say their QKV order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import TypeAdapter

from megatron.checkpointing.discovery import find_gpt_neox_tag
from megatron.checkpointing.local_weights import merge_tp_shards
from megatron.checkpointing.neox.files import gqa_order_for, load_model_file, neox_checkpoint_shards
from megatron.checkpointing.neox.layout import GqaOrder, NeoxNames
from megatron.errors import CheckpointError, ConversionError
from megatron.model.config import Activation, GPTConfig
from megatron.model.mlp_width import GATED_ACTIVATIONS, intermediate_size_for

Weights = dict[str, torch.Tensor]

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_TAG = re.compile(r"^global_step(\d+)$")

# GPT-NeoX's defaults for the keys read here (the same as Deepy's schema)
_DEFAULTS: dict[str, Any] = {
    "pos_emb": "learned", "norm": "layernorm", "activation": "gelu", "rotary_pct": 1.0, "rotary_emb_base": 10000,
    "layernorm_epsilon": 1.0e-5, "gpt_j_residual": False, "gpt_j_tied": False, "no_weight_tying": False,
    "num_kv_heads": None, "init_method_std": 0.02, "hidden_dropout": 0.0, "attention_dropout": 0.0,
    "output_layer_parallelism": "column", "make_vocab_size_divisible_by": 128, "opt_pos_emb_offset": 0,
    "mlp_type": "regular", "use_qk_layernorm": False, "openai_gelu": False, "onnx_safe": False, "use_mup": False,
    "attention_config": None, "tokenizer_type": "GPT2BPETokenizer", "vocab_file": None, "merge_file": None,
    "rms_norm_epsilon": 1.0e-8,
}  # fmt: skip
_PLAIN_ACTIVATIONS = {"gelu", "relu", "silu", "swish", "mish", "softsign"}



@dataclass(frozen=True)
class NeoxCheckpoint:
    path: Path
    config: GPTConfig
    weights: Weights
    iteration: int
    consumed_samples: int
    values: dict[str, Any]
    """The GPT-NeoX config (keys normalized to ``_``), for the tokenizer and batch keys."""
    config_files: dict[str, str]


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)``: reading a foreign checkpoint never runs code from it."""
    return load_model_file(path)


def read_neox_config(paths: list[Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """GPT-NeoX YAML files (``-`` or ``_`` in keys) merged in order -> (values, texts)."""
    values: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConversionError(f"{path}: not a YAML config ({err})") from None
        if not isinstance(data, dict):
            raise ConversionError(f"{path}: a GPT-NeoX config is a mapping of keys to values")
        texts[path.name] = text
        # GPT-NeoX's loader reads `train-iters` as `train_iters` and nothing more (megatron/neox_arguments/
        # arguments.py:251-253, commit ea7aefd8); no key read from these values has another spelling
        values.update({str(k).replace("-", "_"): v for k, v in data.items()})
    return values, texts


def _value(values: dict[str, Any], key: str) -> Any:
    value = values.get(key)
    return _DEFAULTS.get(key) if value is None else value


_GATED_OF_LLAMA_MLP = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu"}
"""GPT-NeoX's mid-2024 ``mlp_type: llama`` gated the configured activation: act(w1 x) * w3 x."""


def _activation(values: dict[str, Any]) -> str:
    act = str(_value(values, "activation"))
    return _GATED_OF_LLAMA_MLP.get(act, act) if _value(values, "mlp_type") == "llama" else act


def _refusals(values: dict[str, Any]) -> list[str]:
    problems = []
    if _value(values, "pos_emb") not in ("rotary", "learned"):
        problems.append(f"pos_emb: {_value(values, 'pos_emb')} (rotary and learned are read)")
    if _value(values, "norm") not in ("layernorm", "rmsnorm"):
        problems.append(f"norm: {_value(values, 'norm')} (layernorm and rmsnorm are read)")
    if _activation(values) not in _PLAIN_ACTIVATIONS | GATED_ACTIVATIONS:
        problems.append(f"activation: {_value(values, 'activation')} with mlp_type: {_value(values, 'mlp_type')}")
    for key in ("openai_gelu", "onnx_safe", "use_mup", "use_qk_layernorm"):
        if _value(values, key):
            problems.append(f"{key}: true")
    if _value(values, "output_layer_parallelism") != "column":
        problems.append(f"output_layer_parallelism: {_value(values, 'output_layer_parallelism')}")
    if _value(values, "mlp_type") not in ("regular", "llama"):
        problems.append(f"mlp_type: {_value(values, 'mlp_type')}")
    attention = _value(values, "attention_config")
    if attention:
        kinds = {k for entry in attention for k in (entry[0] if isinstance(entry, (list, tuple)) else [entry])}
        if kinds - {"global", "flash"}:
            problems.append(f"attention_config: {sorted(kinds)} (only global attention is read)")
    return problems


def _shape_facts(tag: Path, num_layers: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int,
                                                      bool, dict[str, Any]]:
    """Tp rank 0's embedding and first-block tensors, the tp size, whether the head is untied, and
    rank 0's client state: what the model's shape is read from."""
    layer_files: dict[tuple[int, int], Path] = {}
    mp_files: dict[int, Path] = {}
    for file in tag.iterdir():
        if m := _LAYER_FILE.match(file.name):
            layer_files[(int(m.group(1)), int(m.group(2)))] = file
        elif m := _MP_FILE.match(file.name):
            mp_files[int(m.group(1))] = file
    client: dict[str, Any] = _load(mp_files[0]) if 0 in mp_files else {}
    if layer_files:
        tp = 1 + max(rank for _, rank in layer_files)
        missing = [i for i in [0, 2, num_layers + 3] if (i, 0) not in layer_files]
        if missing:
            raise CheckpointError(f"{tag}: no files for GPT-NeoX layer(s) {missing} (num_layers={num_layers})")
        return (_load(layer_files[(0, 0)]), _load(layer_files[(2, 0)]), tp, (num_layers + 4, 0) in layer_files,
                client)
    module = client.get("module") or {}
    if not module:
        raise CheckpointError(f"{tag} holds no model weights (no layer files, and mp_rank_00's module is empty)")

    def layer(index: int) -> dict[str, torch.Tensor]:
        prefix = f"sequential.{index}."
        return {k.removeprefix(prefix): v for k, v in module.items() if k.startswith(prefix)}

    head = any(k.startswith(f"sequential.{num_layers + 4}.") for k in module)
    return layer(0), layer(2), len(mp_files), head, client


def _ffn_width(block: dict[str, torch.Tensor], tp: int) -> int:
    for name in ("mlp.linear2.weight", "mlp.w2.weight", "mlp.dense_4h_to_h.weight"):
        if name in block:
            return int(block[name].shape[1]) * tp
    raise CheckpointError(f"no MLP output weight (mlp.linear2 / w2 / dense_4h_to_h) among {sorted(block)}")


def _intermediate_size(width: int, activation: str) -> int:
    """GPT-NeoX's ``intermediate_size`` that builds the files' MLP, ``width`` wide after the activation
    (each half of a gated one): its width rule (``megatron/model/mlp_width.py``) decides."""
    size = intermediate_size_for(width, gated=activation in GATED_ACTIVATIONS)
    if size is None:
        raise CheckpointError(f"an ungated MLP {width} wide: GPT-NeoX's width rule builds no odd ungated width")
    return size


def read_neox_checkpoint(path: Path, config_paths: list[Path] | None = None,
                         qkv_order: GqaOrder | None = None) -> NeoxCheckpoint:
    """A GPT-NeoX checkpoint of either era (``checkpointing/neox/layout.py``) as full weights;
    ``qkv_order``: the grouped-query row order, which its files cannot say (``--neox-qkv-order``)."""
    tag = find_gpt_neox_tag(path) if path.is_dir() else None
    if tag is None:
        raise ConversionError(f"{path} is not a GPT-NeoX checkpoint (no global_step*/ with DeepSpeed model files)")
    paths = config_paths or sorted(p for p in (tag / "configs").glob("*") if p.suffix in (".yml", ".yaml", ".json"))
    if not paths:
        raise ConversionError(f"{tag} has no configs/ directory; pass the run's GPT-NeoX config files with --config")
    values, texts = read_neox_config(paths)
    problems = _refusals(values)
    for key in ("num_layers", "num_attention_heads"):
        if not isinstance(values.get(key), int):
            problems.append(f"the GPT-NeoX config ({', '.join(map(str, paths))}) does not set {key}")
    if problems:
        raise ConversionError(f"{tag} uses features this converter does not read:\n  - " + "\n  - ".join(problems))
    num_layers = int(values["num_layers"])
    embedding, first, tp, untied, client = _shape_facts(tag, num_layers)
    config = _config(values, embedding, first, tp, untied, num_layers)
    names = gqa_order_for(NeoxNames.from_config(config), None, qkv_order, tag, key="--neox-qkv-order")
    shards, _ = neox_checkpoint_shards(tag, names)
    weights = {k: v for k, v in merge_tp_shards(config, shards).items() if not k.endswith("rotary.inv_freq")}
    if config.gpt_j_tied:  # one shared norm: the second (unused) one is not part of our model
        weights = {k: v for k, v in weights.items() if ".post_attention_layernorm." not in k}
    match = _TAG.match(tag.name)
    iteration = int(client.get("iteration") or (match.group(1) if match else 0))
    consumed = client.get("global_samples")
    if consumed is None:
        consumed = iteration * int(values.get("train_batch_size") or 0)
    return NeoxCheckpoint(tag, config, weights, iteration, int(consumed), values, texts)


def _config(values: dict[str, Any], embedding: dict[str, torch.Tensor], first: dict[str, torch.Tensor], tp: int,
            untied: bool, num_layers: int) -> GPTConfig:
    word = embedding["word_embeddings.weight"]
    vocab, hidden = int(word.shape[0]) * tp, int(word.shape[1])
    if tp > 1 and vocab % tp:
        raise CheckpointError(f"embedding rows {vocab} are not divisible by the {tp} tp ranks found")
    seq = int(values.get("seq_length") or values.get("max_position_embeddings") or 2048)
    # typed as GPTConfig validates them (after _refusals kept the kinds this reader maps)
    norm = str(_value(values, "norm"))  # GPTConfig checks it against the norms' registry
    activation = TypeAdapter(Activation).validate_python(_activation(values))
    return GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=int(values["num_attention_heads"]),
        num_kv_heads=values.get("num_kv_heads"),
        seq_length=seq,
        max_position_embeddings=int(values.get("max_position_embeddings") or seq),
        padded_vocab_size=vocab,
        pos_emb=_value(values, "pos_emb"),
        rotary_pct=float(_value(values, "rotary_pct")),
        rotary_emb_base=int(_value(values, "rotary_emb_base")),
        opt_pos_emb_offset=int(_value(values, "opt_pos_emb_offset")),
        norm=norm,
        layernorm_epsilon=float(_value(values, "layernorm_epsilon")),
        rms_norm_epsilon=float(_value(values, "rms_norm_epsilon")),
        use_bias_in_norms="input_layernorm.bias" in first,
        use_bias_in_attn_linear="attention.query_key_value.bias" in first,
        use_bias_in_mlp=any(f"mlp.{n}.bias" in first for n in ("linear1", "dense_h_to_4h", "w1")),
        activation=activation,
        intermediate_size=_intermediate_size(_ffn_width(first, tp), activation),
        gpt_j_residual=bool(_value(values, "gpt_j_residual")),
        gpt_j_tied=bool(_value(values, "gpt_j_tied")),
        no_weight_tying=untied,
        init_method_std=float(_value(values, "init_method_std")),
        hidden_dropout=float(_value(values, "hidden_dropout")),
        attention_dropout=float(_value(values, "attention_dropout")),
    )
