"""Model files in GPT-NeoX's layout: written by the engine, read back by the engine and by our tools.

The engine's own module save/load is where the translation of ``layout.py`` is applied:

* pipeline models: DeepSpeed's ``PipelineModule.save_state_dict``/``load_state_dir`` write and read
  one file per layer, numbered by spec; :func:`install` replaces both on the module instance with
  versions that number files as GPT-NeoX does and translate each layer's tensors (DeepSpeed has no
  hook for either, hence our own two loops);
* plain models: the engine's ``module_state_dict``/``load_module_state_dict`` are wrapped so the
  ``module`` entry of ``mp_rank_XX_model_states.pt`` holds GPT-NeoX's ``sequential.*`` names.

Reading recognises the layouts by their files: Deepy's first layout (format 1) always has a
``layer_01-*`` file (GPT-NeoX's layer 1 has no parameters) and plain ``module`` names without
``sequential.``; GPT-NeoX's names of either era are told apart by ``layout.py``. The one thing files
cannot tell is the grouped-query QKV order: a Deepy checkpoint records it by its format
(``deepy_meta.json`` and the ``deepy`` client state: 2 = GPT-NeoX's order before Nov 2024, 3 = its
current one); for a GPT-NeoX checkpoint the key ``neox_qkv_order`` says it, and without it a
grouped-query checkpoint is refused (:func:`gqa_order_for`). So checkpoints of earlier Deepy
releases load (and resume exactly) unchanged.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # the same function, older path

from megatron.checkpointing.discovery import META_FILE
from megatron.checkpointing.neox.layout import (
    PER_QUERY_HEAD,
    PER_RANK,
    GqaOrder,
    NeoxNames,
    Tensors,
    is_neox_plain,
    layer_from_neox,
    layer_to_neox,
    plain_from_neox,
    plain_to_neox,
)
from megatron.checkpointing.safe_load import load_checkpoint_file
from megatron.deepspeed_internals import (
    checkpoint_being_loaded,
    convert_module_state_dicts,
    pipeline_grid,
    pipeline_local_start,
    replace_pipeline_layer_io,
    synchronize_tied_weights,
)
from megatron.errors import CheckpointError

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
CLIENT_KEY = "deepy"
GQA_ORDER_OF_FORMAT: dict[int, GqaOrder] = {2: PER_QUERY_HEAD, 3: PER_RANK}
"""The grouped-query QKV order of each Deepy checkpoint format in GPT-NeoX's layout (``save_load.FORMAT_VERSION``)."""
ORDER_KEY = "neox_qkv_order"
"""The config key that says a GPT-NeoX checkpoint's grouped-query order (``checkpointing/config.py``)."""


def is_earlier_deepy_pipeline(ckpt_dir: Path) -> bool:
    """Pipeline layer files numbered by Deepy's spec (releases before GPT-NeoX's layout)."""
    return any(ckpt_dir.glob("layer_01-*model_states.pt"))


def recorded_format(ckpt_dir: Path) -> int | None:
    """The format a Deepy checkpoint records in ``deepy_meta.json``; None without one (GPT-NeoX's)."""
    try:
        meta = json.loads((ckpt_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    return int(fmt) if isinstance(fmt, int) else None


def as_recorded(names: NeoxNames, fmt: int | None) -> NeoxNames:
    """``names`` reading the QKV order Deepy's checkpoint format ``fmt`` holds (None: as given)."""
    order = GQA_ORDER_OF_FORMAT.get(fmt) if fmt is not None else None
    return names.reading(order) if order is not None else names


def gqa_order_for(names: NeoxNames, fmt: int | None, chosen: GqaOrder | None, where: Path,
                  key: str = ORDER_KEY) -> NeoxNames:
    """``names`` reading a checkpoint's grouped-query rows: in the order its Deepy format records, else
    in ``chosen`` (the ``key`` the user set). Refused where nothing says it, or the two disagree."""
    recorded = GQA_ORDER_OF_FORMAT.get(fmt) if fmt is not None else None
    if recorded is not None and chosen is not None and chosen != recorded and names.grouped_query:
        raise CheckpointError(f"{key}: {chosen}, but {where} is a Deepy checkpoint (format {fmt}) whose grouped-query "
                              f"QKV rows are {recorded}: remove {key} (it is only for GPT-NeoX's checkpoints)")
    order = recorded or chosen
    if order is None and names.grouped_query:
        raise CheckpointError(
            f"{where} is a GPT-NeoX checkpoint of a grouped-query model (num_kv_heads={names.kv_heads} < "
            f"num_attention_heads={names.heads}) and its files do not say in which order its QKV rows are: set "
            f"{key}: {PER_RANK} (GPT-NeoX since Nov 2024, #1315; its HF converter since May 2025, #1345) or "
            f"{key}: {PER_QUERY_HEAD} (earlier GPT-NeoX). A wrong choice gives a different model."
        )
    return names.reading(order) if order is not None else names


# --- the engine ------------------------------------------------------------------------------
def install(engine: Any, config: Any, tp: int) -> None:
    """Make ``engine``'s checkpoints use GPT-NeoX's layout for ``config`` (a ``GPTConfig``)."""
    # lazy: DeepSpeed; reading and converting GPT-NeoX checkpoints offline runs without it
    from deepspeed.runtime.pipe.engine import PipelineEngine

    names = NeoxNames.from_config(config)
    if isinstance(engine, PipelineEngine):
        module = engine.module
        replace_pipeline_layer_io(module, save=partial(_save_pipeline_layers, module, names, tp),
                                  load=partial(_load_pipeline_layers, module, names, tp))
        return

    loading = checkpoint_being_loaded(engine)  # its deepy_meta.json records the format of older files

    def from_neox(checkpoint: Any) -> Any:
        module = checkpoint.get("module") if isinstance(checkpoint, dict) else None
        if isinstance(module, dict) and is_neox_plain(module):
            directory = loading()
            fmt = _client_format(checkpoint) or (recorded_format(Path(directory)) if directory else None)
            if fmt is None and names.grouped_query:
                raise CheckpointError("the checkpoint being loaded records no Deepy format, so the order of its "
                                      "grouped-query QKV rows is unknown")
            checkpoint = {**checkpoint, "module": plain_from_neox(as_recorded(names, fmt), module, tp)}
        return checkpoint

    convert_module_state_dicts(engine, on_save=lambda weights: plain_to_neox(names, weights, tp), on_load=from_neox)


def _save_pipeline_layers(module: Any, names: NeoxNames, tp: int, save_dir: str, checkpoint_engine: Any,
                          exclude_frozen_params: bool = False) -> None:
    # lazy: DeepSpeed; reading and converting GPT-NeoX checkpoints offline runs without it
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    start = pipeline_local_start(module)
    if pipeline_grid(module).data_parallel_id != 0:
        return  # every data-parallel replica holds the same layers: replica 0 writes them
    checkpoint_engine.makedirs(save_dir, exist_ok=True)
    for local, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue  # the tied head: its weight is the embedding's, written with layer 0
        spec = start + local
        state = layer.state_dict()
        if exclude_frozen_params:
            for name, param in layer.named_parameters():
                if not param.requires_grad:
                    state.pop(name, None)
        state = clone_tensors_for_torch_save(layer_to_neox(names, spec, state, tp))
        path = module.ckpt_layer_path(save_dir, names.neox_index(spec) - start)
        checkpoint_engine.save(state, path)


def _load_pipeline_layers(module: Any, names: NeoxNames, tp: int, load_dir: str, checkpoint_engine: Any,
                          strict: bool = True) -> None:
    directory = Path(load_dir)
    neox = not is_earlier_deepy_pipeline(directory)
    names = as_recorded(names, recorded_format(directory))
    tp_rank = pipeline_grid(module).get_slice_parallel_rank()
    start = pipeline_local_start(module)
    for local, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        spec = start + local
        index = names.neox_index(spec) if neox else spec
        files = sorted(directory.glob(f"layer_{index:02d}-*model_states.pt"))
        if len(files) != tp:
            raise CheckpointError(f"{directory} has {len(files)} file(s) for layer {index} (layer_{index:02d}-model_XX-"
                                  f"model_states.pt), this run reads {tp} (one per tp rank)")
        state = checkpoint_engine.load(str(files[tp_rank]), map_location="cpu")
        if neox:
            state = layer_from_neox(names, spec, state, tp)
        layer.load_state_dict(state, strict=strict)
    synchronize_tied_weights(module)


# --- offline readers ---------------------------------------------------------------------------------
def _numpy_rng_globals() -> list[Any]:
    """What numpy's RNG state unpickles to: GPT-NeoX saves ``np_rng_state`` in its model files."""
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct]


def load_model_file(path: Path) -> Any:
    """One model file of a Deepy or GPT-NeoX checkpoint, read with ``weights_only`` (no code runs)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        return load_checkpoint_file(path)


def _client_format(state: Any) -> int | None:
    client = state.get(CLIENT_KEY) if isinstance(state, dict) else None
    fmt = client.get("format") if isinstance(client, dict) else None
    return int(fmt) if isinstance(fmt, int) else None


def layer_files(ckpt_dir: Path) -> dict[int, dict[int, Path]]:
    """layer index -> tp rank -> file."""
    files: dict[int, dict[int, Path]] = defaultdict(dict)
    for file in ckpt_dir.iterdir():
        if match := _LAYER_FILE.match(file.name):
            files[int(match.group(1))][int(match.group(2))] = file
    return files


def pipeline_rank_weights(ckpt_dir: Path, names: NeoxNames, tp: int, tp_rank: int) -> dict[int, Tensors]:
    """Deepy's spec -> that layer's tensors (Deepy's names inside the layer) on ``tp_rank``,
    from any layout (a Deepy checkpoint's recorded QKV order wins over ``names.gqa_order``)."""
    neox = not is_earlier_deepy_pipeline(ckpt_dir)
    names = as_recorded(names, recorded_format(ckpt_dir))
    out: dict[int, Tensors] = {}
    for index, per_rank in sorted(layer_files(ckpt_dir).items()):
        spec = names.spec_index(index) if neox else index
        if spec is None:
            raise CheckpointError(f"{ckpt_dir}: GPT-NeoX layer {index} has parameters, but for num_layers="
                                  f"{names.num_layers} it is a step without any: the config does not match")
        if tp_rank not in per_rank:
            raise CheckpointError(f"{ckpt_dir / f'layer_{index:02d}-model_{tp_rank:02d}-model_states.pt'} is missing")
        state = load_model_file(per_rank[tp_rank])
        out[spec] = layer_from_neox(names, spec, state, tp) if neox else state
    if not out:
        raise CheckpointError(f"{ckpt_dir} has no layer_*-model_*-model_states.pt files for its pipeline layout")
    return out


def plain_rank_weights(state: dict[str, Any], names: NeoxNames, tp: int, source: Path) -> Tensors:
    """Deepy's names for the ``module`` of one ``mp_rank_XX_model_states.pt``, from either layout."""
    module = state.get("module") if isinstance(state, dict) else None
    if not isinstance(module, dict) or not module:
        raise CheckpointError(f"{source} holds no model weights")
    if not is_neox_plain(module):
        return dict(module)
    return plain_from_neox(as_recorded(names, _client_format(state)), module, tp)


def canonical_rank_weights(ckpt_dir: Path, names: NeoxNames, tp: int, tp_rank: int, pipeline: bool) -> Tensors:
    """One tp rank's tensors under ``GPTModel`` names, from a checkpoint of either layout."""
    # lazy: DeepSpeed; reading and converting GPT-NeoX checkpoints offline runs without it
    from megatron.model.pipeline import model_parameter_name

    if not pipeline:
        path = ckpt_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
        return plain_rank_weights(load_model_file(path), as_recorded(names, recorded_format(ckpt_dir)), tp, path)
    out: Tensors = {}
    for spec, state in pipeline_rank_weights(ckpt_dir, names, tp, tp_rank).items():
        out.update({model_parameter_name(f"{spec}.{local}"): t for local, t in state.items()})
    return out


def neox_checkpoint_shards(tag: Path, names: NeoxNames) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Every tp rank's tensors of a GPT-NeoX checkpoint (plain or pipeline), under ``GPTModel`` names;
    grouped-query rows read in ``names.gqa_order`` (see :func:`gqa_order_for`)."""
    files = layer_files(tag)
    pipeline = bool(files)
    if pipeline:
        tp = len(files.get(0, {})) or max(len(ranks) for ranks in files.values())
    else:
        tp = sum(1 for p in tag.iterdir() if _MP_FILE.match(p.name))
    if tp == 0:
        raise CheckpointError(f"{tag} holds no model files (layer_*-model_*-model_states.pt or "
                              "mp_rank_*_model_states.pt)")
    if names.heads % tp or names.kv_heads % tp:
        raise CheckpointError(f"{tag} was saved with {tp} tensor-parallel ranks, which do not divide "
                              f"num_attention_heads={names.heads} / num_kv_heads={names.kv_heads} of the config")
    shards: dict[str, list[torch.Tensor]] = defaultdict(list)
    for tp_rank in range(tp):
        for name, t in canonical_rank_weights(tag, names, tp, tp_rank, pipeline).items():
            shards[name].append(t)
    return shards, tp
