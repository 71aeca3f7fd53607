"""A GPT-NeoX (DeeperSpeed) checkpoint directory read into full weights under our names.

Facts of the format (GPT-NeoX's ``megatron/checkpointing.py``, ``megatron/model`` and its own
``tools/ckpts/convert_neox_to_hf.py``):

* ``<save>/global_step<N>/``, with ``<save>/latest`` naming the newest tag; the run's YAML files
  are copied to ``global_step<N>/configs/``; ``mp_rank_XX_model_states.pt`` carries the client
  state ``iteration`` and ``args``.
* pipeline models (``pipe_parallel_size >= 1``): one file per layer and tp rank,
  ``layer_<idx>-model_<tp>-model_states.pt``, names relative to the layer. Layer indices: 0 the
  embedding (``word_embeddings.weight``, ``position_embeddings.weight``), 1 a parameter-free
  pre-transformer step, 2..L+1 the blocks, L+2 a parameter-free step, L+3 the final norm
  (``norm.weight``/``norm.bias``), L+4 the output layer (``final_linear.weight``; absent when tied).
* plain models (``pipe_parallel_size: 0``): ``mp_rank_<tp>_model_states.pt["module"]`` with the same
  names under ``sequential.<idx>.``.
* block names: ``input_layernorm``, ``attention.query_key_value`` (per head ``[q; k; v]``, the
  layout transformers' GPTNeoX uses), ``attention.dense``, ``post_attention_layernorm``,
  ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h`` (+ a saved ``attention.rotary_emb.inv_freq``).
* tensor parallelism: column-parallel rows and the vocabulary split on dim 0, row-parallel weights
  on dim 1, norms replicated. Row-parallel *biases* are replicated, but with ``gpt_j_residual`` each
  rank adds its copy before the all-reduce that joins the ranks, so the bias the model computes with
  is the sum of the copies; without it the bias is added once, after the reduce.

What is read is limited to what can be checked against an independent implementation (the
GPTNeoX model in transformers): layernorm, rotary or learned positions, non-gated activations,
full multi-head attention. Anything else is refused with the key named.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron.checkpointing.discovery import find_gpt_neox_tag
from megatron.errors import CheckpointError, ConversionError
from megatron.interop.hf_weights import qkv_neox_to_ours
from megatron.model.config import GPTConfig
from megatron.neox_arguments.keys import normalize_key

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
    from megatron.checkpointing.neox_files import load_model_file

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
        values.update({normalize_key(str(k)): v for k, v in data.items()})
    return values, texts


def _value(values: dict[str, Any], key: str) -> Any:
    value = values.get(key)
    return _DEFAULTS.get(key) if value is None else value


def _refusals(values: dict[str, Any]) -> list[str]:
    problems = []
    if _value(values, "pos_emb") not in ("rotary", "learned"):
        problems.append(f"pos_emb: {_value(values, 'pos_emb')} (rotary and learned are read)")
    if _value(values, "norm") != "layernorm":
        problems.append(f"norm: {_value(values, 'norm')} (layernorm is read; GPT-NeoX's rmsnorm adds epsilon outside "
                        "the square root, Deepy's inside)")
    if _value(values, "activation") not in _PLAIN_ACTIVATIONS:
        act = _value(values, "activation")
        problems.append(f"activation: {act} (gated MLP layouts differ across GPT-NeoX versions)")
    for key in ("openai_gelu", "onnx_safe", "use_mup", "use_qk_layernorm"):
        if _value(values, key):
            problems.append(f"{key}: true")
    if _value(values, "mlp_type") != "regular":
        problems.append(f"mlp_type: {_value(values, 'mlp_type')}")
    kv, heads = _value(values, "num_kv_heads"), values.get("num_attention_heads")
    if kv is not None and kv != heads:
        problems.append(f"num_kv_heads: {kv} (grouped-query attention)")
    attention = _value(values, "attention_config")
    if attention:
        kinds = {k for entry in attention for k in (entry[0] if isinstance(entry, (list, tuple)) else [entry])}
        if kinds - {"global", "flash"}:
            problems.append(f"attention_config: {sorted(kinds)} (only global attention is read)")
    return problems


def _merge(parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    return parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)


def _collect(tag: Path) -> tuple[dict[int, dict[str, list[torch.Tensor]]], int, dict[str, Any]]:
    """Per GPT-NeoX layer index: name -> one tensor per tp rank; the tp size; rank 0's client state."""
    layer_files: dict[tuple[int, int], Path] = {}
    mp_files: dict[int, Path] = {}
    for file in tag.iterdir():
        if m := _LAYER_FILE.match(file.name):
            layer_files[(int(m.group(1)), int(m.group(2)))] = file
        elif m := _MP_FILE.match(file.name):
            mp_files[int(m.group(1))] = file
    client: dict[str, Any] = _load(mp_files[0]) if 0 in mp_files else {}
    layers: dict[int, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    if layer_files:
        tp = 1 + max(rank for _, rank in layer_files)
        for (index, rank), file in sorted(layer_files.items()):
            for name, tensor in _load(file).items():
                layers[index][name].append(tensor)
        return layers, tp, client
    tp = len(mp_files)
    for rank in range(tp):
        state = client if rank == 0 else _load(mp_files[rank])
        module = state.get("module") or {}
        if not module:
            raise CheckpointError(f"{mp_files[rank]} holds no model weights")
        for name, tensor in module.items():
            match = re.match(r"^sequential\.(\d+)\.(.+)$", name)
            if match:
                layers[int(match.group(1))][match.group(2)].append(tensor)
    return layers, tp, client


def read_neox_checkpoint(path: Path, config_paths: list[Path] | None = None) -> NeoxCheckpoint:
    tag = find_gpt_neox_tag(path) if path.is_dir() else None
    if tag is None:
        raise ConversionError(f"{path} is not a GPT-NeoX checkpoint (no global_step*/ with DeepSpeed model files)")
    paths = config_paths or sorted(p for p in (tag / "configs").glob("*") if p.suffix in (".yml", ".yaml", ".json"))
    if not paths:
        raise ConversionError(f"{tag} has no configs/ directory; pass the run's GPT-NeoX config files with --config")
    values, texts = read_neox_config(paths)
    problems = _refusals(values)
    if problems:
        raise ConversionError(f"{tag} uses features this converter does not read:\n  - " + "\n  - ".join(problems))
    for key in ("num_layers", "num_attention_heads"):
        if not isinstance(values.get(key), int):
            raise ConversionError(f"the GPT-NeoX config ({', '.join(map(str, paths))}) does not set {key}")
    layers, tp, client = _collect(tag)
    num_layers = int(values["num_layers"])
    missing = [i for i in [0, *range(2, num_layers + 2), num_layers + 3] if i not in layers]
    if missing:
        raise CheckpointError(
            f"{tag}: no weights for GPT-NeoX layer(s) {missing} (num_layers={num_layers} in the config)"
        )
    weights, config = _to_ours(values, layers, tp, num_layers)
    match = _TAG.match(tag.name)
    iteration = int(client.get("iteration") or (match.group(1) if match else 0))
    consumed = client.get("global_samples")
    if consumed is None:
        consumed = iteration * int(values.get("train_batch_size") or 0)
    return NeoxCheckpoint(tag, config, weights, iteration, int(consumed), values, texts)


def _to_ours(
    values: dict[str, Any], layers: dict[int, dict[str, list[torch.Tensor]]], tp: int, num_layers: int
) -> tuple[Weights, GPTConfig]:
    gpt_j = bool(_value(values, "gpt_j_residual"))
    heads = int(values["num_attention_heads"])
    embedding = layers[0]
    word = _merge(embedding["word_embeddings.weight"], 0)
    hidden = int(word.shape[1])
    d = hidden // heads
    weights: Weights = {"embedding.word_embeddings.weight": word}
    if "position_embeddings.weight" in embedding:
        weights["embedding.position_embeddings.weight"] = embedding["position_embeddings.weight"][0]

    def row_bias(parts: list[torch.Tensor]) -> torch.Tensor:
        # gpt_j_residual: every rank adds its copy before the all-reduce, so the model's bias is their sum
        return torch.stack(parts).sum(0) if gpt_j else parts[0]

    first = layers[2]
    for i in range(num_layers):
        src, ours = layers[i + 2], f"layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            for field in ("weight", "bias"):
                if f"{norm}.{field}" in src:
                    weights[f"{ours}.{norm}.{field}"] = src[f"{norm}.{field}"][0]
        qkv = _merge(src["attention.query_key_value.weight"], 0)
        weights[f"{ours}.attention.query_key_value.weight"] = qkv_neox_to_ours(qkv, heads, d)
        weights[f"{ours}.attention.dense.weight"] = _merge(src["attention.dense.weight"], 1)
        if "attention.query_key_value.bias" in src:
            bias = _merge(src["attention.query_key_value.bias"], 0)
            weights[f"{ours}.attention.query_key_value.bias"] = qkv_neox_to_ours(bias, heads, d)
            weights[f"{ours}.attention.dense.bias"] = row_bias(src["attention.dense.bias"])
        weights[f"{ours}.mlp.dense_h_to_4h.weight"] = _merge(src["mlp.dense_h_to_4h.weight"], 0)
        weights[f"{ours}.mlp.dense_4h_to_h.weight"] = _merge(src["mlp.dense_4h_to_h.weight"], 1)
        if "mlp.dense_h_to_4h.bias" in src:
            weights[f"{ours}.mlp.dense_h_to_4h.bias"] = _merge(src["mlp.dense_h_to_4h.bias"], 0)
            weights[f"{ours}.mlp.dense_4h_to_h.bias"] = row_bias(src["mlp.dense_4h_to_h.bias"])
        if _value(values, "gpt_j_tied"):  # one shared norm: the second (unused) one is not part of our model
            weights.pop(f"{ours}.post_attention_layernorm.weight", None)
            weights.pop(f"{ours}.post_attention_layernorm.bias", None)
    norm = layers[num_layers + 3]
    weights["final_norm.weight"] = norm["norm.weight"][0]
    if "norm.bias" in norm:
        weights["final_norm.bias"] = norm["norm.bias"][0]
    head = layers.get(num_layers + 4, {}).get("final_linear.weight")
    if head is not None:
        column = _value(values, "output_layer_parallelism") == "column"
        weights["output_layer.weight"] = _merge(head, 0 if column else 1)

    seq = int(values.get("seq_length") or values.get("max_position_embeddings") or 2048)
    config = GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,  # num_kv_heads unset: one key/value head per query head
        seq_length=seq,
        max_position_embeddings=int(values.get("max_position_embeddings") or seq),
        padded_vocab_size=int(word.shape[0]),
        pos_emb=_value(values, "pos_emb"),
        rotary_pct=float(_value(values, "rotary_pct")),
        rotary_emb_base=int(_value(values, "rotary_emb_base")),
        opt_pos_emb_offset=int(_value(values, "opt_pos_emb_offset")),
        norm="layernorm",
        layernorm_epsilon=float(_value(values, "layernorm_epsilon")),
        use_bias_in_norms="input_layernorm.bias" in first,
        use_bias_in_attn_linear="attention.query_key_value.bias" in first,
        use_bias_in_mlp="mlp.dense_h_to_4h.bias" in first,
        activation=_value(values, "activation"),
        intermediate_size=int(weights["layers.0.mlp.dense_h_to_4h.weight"].shape[0]),
        gpt_j_residual=gpt_j,
        gpt_j_tied=bool(_value(values, "gpt_j_tied")),
        no_weight_tying=head is not None,
        init_method_std=float(_value(values, "init_method_std")),
        hidden_dropout=float(_value(values, "hidden_dropout")),
        attention_dropout=float(_value(values, "attention_dropout")),
    )
    if tp > 1 and config.padded_vocab_size % tp:
        raise CheckpointError(f"embedding rows {config.padded_vocab_size} are not divisible by the {tp} tp ranks found")
    return weights, config
