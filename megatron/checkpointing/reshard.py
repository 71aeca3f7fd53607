"""The full training state in DeepSpeed's universal layout, for every layout DeepSpeed's own tools miss.

A universal checkpoint (``<tag>_universal/``) holds one folder per parameter under ``zero/`` with
its full, unsharded fp32 weight, Adam moments and step (``fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt``, ``step.pt``), the optimizer's global state (``zero/optimizer_state.pt``) and the
engine's model-state files (LR scheduler, step counters). DeepSpeed 0.19.8 writes one from ZeRO-1/2/3
checkpoints (``ds_to_universal``) and loads one into ZeRO-1/2/3 engines. What it does not do, and
this module does:

* **read ZeRO-0**: without ZeRO, an fp32 run keeps its master weights in the module files and its
  Adam state in a torch optimizer state dict per model-parallel rank, with no ZeRO files for the
  converter to read. :func:`zero0_to_universal` hands every tensor-parallel shard to DeepSpeed's own
  merge step (``merge_tp_slices``), so the result is what ``ds_to_universal`` would have written;
  the optimizer entries are matched to parameters by the names each rank saved next to them
  (:func:`optimizer_param_names`), since a torch state dict numbers them by position only.
* **serve every target**: the pipeline model names parameters by layer spec (``3.attention...``,
  ``tied_modules.embed...``), the plain model by module path (``layers.2.attention...``,
  ``embedding...``). :func:`complete_for_any_target` links each parameter's folder under both
  names, writes an optimizer-state file both ZeRO-1/2 and ZeRO-3 loaders read, gives the model-state
  files the names each stage looks for, and fits the padded vocabulary to the loading run.
* **load ZeRO-0**: an engine without ZeRO trains its module's fp32 weights with a torch optimizer,
  which DeepSpeed's universal loader does not fill. :func:`load_into_torch_optimizer` cuts each full
  tensor for this tensor-parallel rank with the partition the parameter itself records (set by
  the tensor-parallel layers) and loads weights, moments, step, LR schedule and step counters.
* **carry frozen weights**: both converters write the optimizer's parameters only, and DeepSpeed's
  universal loader fills only those. A LoRA run's base is frozen (no optimizer state), so without
  more it would come back at its initialisation after a layout change. :func:`write_frozen_parameters`
  gives every frozen weight its full ``fp32.pt`` (merged over tp from the model files, or rebuilt by
  DeepSpeed's ``zero_to_fp32`` for ZeRO-3) and :func:`load_frozen_parameters` loads them into ZeRO-1/2/3
  engines (a ZeRO-0 engine reads every weight anyway).

Every function here runs on files of one checkpoint; only :func:`load_into_torch_optimizer` touches
an engine. Everything is read with the weights-only loader (see ``safe_load.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAMETER_WITH_SUB_PARAMS, PARAM_GROUPS
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from megatron.checkpointing.local_weights import computed_buffer, merge_tp_shards, stored_model_config
from megatron.checkpointing.neox import NeoxNames, canonical_rank_weights, pipeline_rank_weights, plain_rank_weights
from megatron.checkpointing.safe_load import load_checkpoint_file, weights_only_loading
from megatron.deepspeed_internals import merge_universal_tp_slices, restore_engine_counters
from megatron.errors import CheckpointError
from megatron.model.pipeline import (
    is_pipeline_parameter_name,
    model_parameter_name,
    pipeline_file_name,
    pipeline_parameter_name,
)
from megatron.model.soft_prompt_settings import SoftPromptSettings
from megatron.mpu import topology
from megatron.mpu.initialize_weights import shard_tensor, tensor_parallel_partition

ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq")
OPTIMIZER_PARAMS_KEY = "optimizer_params"
"""Key (in Deepy's client state) of :func:`optimizer_param_names`."""
_MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    return load_checkpoint_file(path)


# --- ZeRO-0 sources ----------------------------------------------------------------------------------------------
def plain_torch_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The engine's optimizer when it is a bare torch optimizer (fp32 without ZeRO), else None:
    DeepSpeed's ZeRO, bf16 and fp16 optimizers are wrappers of their own."""
    optimizer = engine.optimizer
    if engine.zero_optimization() or not isinstance(optimizer, torch.optim.Optimizer):
        return None
    return optimizer


def optimizer_param_names(engine: Any) -> list[list[str]] | None:
    """This rank's module name of every entry of the torch optimizer, group by group; None when the
    optimizer is not a bare torch optimizer (ZeRO's own files name their parameters)."""
    optimizer = plain_torch_optimizer(engine)
    if optimizer is None:
        return None
    names = {id(param): name for name, param in engine.module.named_parameters()}
    groups = [[names.get(id(param)) for param in group["params"]] for group in optimizer.param_groups]
    if any(name is None for group in groups for name in group):
        return None  # an optimizer over tensors outside the module: nothing we could map
    return [[name for name in group if name is not None] for group in groups]


def has_zero_files(ckpt_dir: Path) -> bool:
    """DeepSpeed wrote optimizer partitions (ZeRO 1-3, or the bf16 optimizer): ``ds_to_universal`` reads them."""
    return any(ckpt_dir.glob("*_optim_states.pt"))


def zero0_to_universal(ckpt_dir: Path, target: Path, tp: int, stages: int, pipeline: bool,
                       info: dict[str, Any], layer_names: NeoxNames) -> None:
    """Write the universal checkpoint of a ZeRO-0 fp32 checkpoint into ``target`` (GPTModel names).

    ``info`` is the checkpoint's ``universal_checkpoint_info`` (how the model splits over tp);
    ``layer_names`` reads its model files (GPT-NeoX's layout, or Deepy's earlier one).
    """
    info = _with_tuple_shapes(info)
    slices = target / "tmp"
    shapes: dict[str, list[torch.Size]] = defaultdict(list)
    groups: list[dict[str, Any]] = []
    step: Any = None
    for tp_rank in range(tp):
        seen: set[str] = set()
        for stage in range(stages):
            model_file = ckpt_dir / f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"
            state = _load(model_file)
            names = (state.get("deepy") or {}).get(OPTIMIZER_PARAMS_KEY)
            optimizer = state.get("optimizer")
            if not names or not isinstance(optimizer, dict) or "state" not in optimizer:
                raise CheckpointError(
                    f"{model_file} holds no optimizer state Deepy can map to parameters (saved without ZeRO by an "
                    "fp16/bf16 run, or by a Deepy from before layout changes at ZeRO-0): resume it at the layout "
                    "it was saved at")
            groups = groups or [dict(group) for group in optimizer[PARAM_GROUPS]]
            weights = _rank_weights(ckpt_dir, tp, tp_rank, pipeline, layer_names, names, state, model_file)
            for group_names, group in zip(names, optimizer[PARAM_GROUPS]):
                for name, index in zip(group_names, group["params"]):
                    canonical = model_parameter_name(name) if pipeline else name
                    if canonical in seen:
                        continue  # the tied embedding, held by the first and the last stage alike
                    seen.add(canonical)
                    weight = weights[name]
                    entry = optimizer["state"].get(index, {})
                    step = entry.get("step", step)
                    fragments = {"fp32": weight.float(), "exp_avg": entry.get("exp_avg"),
                                 "exp_avg_sq": entry.get("exp_avg_sq"), "step": entry.get("step")}
                    for key, value in fragments.items():
                        if value is None:
                            continue
                        out = slices / canonical / str(tp_rank) / f"{key}.00"  # DeepSpeed's fragment naming
                        out.parent.mkdir(parents=True, exist_ok=True)
                        torch.save(value.flatten() if key != "step" else value, out)
                    shapes[canonical].append(weight.shape)
    for name, per_tp in sorted(shapes.items()):
        merge_universal_tp_slices(info, target / ZERO_DIR, slices, tp, name, per_tp)
    shutil.rmtree(slices, ignore_errors=True)
    union = {PARAM_GROUPS: groups}
    torch.save(_optimizer_state_for_every_stage(union, step), target / ZERO_DIR / OPTIMIZER_STATE_FILE)
    for model_file in sorted(ckpt_dir.glob("mp_rank_*_model_states.pt")):
        state = _load(model_file)
        state["optimizer"] = None  # the source layout's optimizer: read above, meaningless to a loader
        torch.save(state, target / model_file.name)


def _with_tuple_shapes(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` as DeepSpeed writes it: ``deepy_meta.json`` turned the sub-parameter shapes into
    lists, which DeepSpeed's loader later hands to ``Tensor.view`` (it takes tuples only)."""
    def as_tuple(value: Any) -> Any:
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    subs = [{**sub, "shape": as_tuple(sub["shape"])} for sub in info.get(PARAMETER_WITH_SUB_PARAMS, [])]
    return {**info, PARAMETER_WITH_SUB_PARAMS: subs}


def _rank_weights(ckpt_dir: Path, tp: int, tp_rank: int, pipeline: bool, layer_names: NeoxNames,
                  names: list[list[str]], state: dict[str, Any], model_file: Path) -> dict[str, torch.Tensor]:
    """This rank's weights under the module names its optimizer entries were saved with."""
    if not pipeline:
        return plain_rank_weights(state, layer_names, tp, model_file)
    wanted = {name for group in names for name in group}
    full = {}
    for spec, layer in pipeline_rank_weights(ckpt_dir, layer_names, tp, tp_rank).items():
        full.update({f"{spec}.{local}": t for local, t in layer.items()})
    # the tied embedding is named tied_modules.embed.<name> by the module, 0.<name> in its file (a shared block:
    # tied_modules.shared_block_<owner>.<name>, <owner + 1>.<name>)
    return {name: full[pipeline_file_name(name)] for name in wanted}


# --- making a universal checkpoint loadable by any target -------------------------------------------------------
def complete_for_any_target(universal: Path, *, num_layers: int, tied: bool, vocab_rows: int | None,
                            vocab_patterns: list[str], info: dict[str, Any] | None = None,
                            shared: frozenset[int] = frozenset()) -> None:
    """Make ``universal`` loadable by a plain or pipeline engine at any ZeRO stage (idempotent).

    ``vocab_rows``: the loading run's padded vocabulary (a smaller tp pads less, a larger one more;
    the rows added or dropped are padding beyond the tokenizer's vocabulary). ``info``: the checkpoint's
    ``universal_checkpoint_info`` (how each parameter splits over tp). ``shared``: the owners of blocks that
    several positions share (``num_unique_layers``), named as tied modules by a pipeline.
    """
    zero = universal / ZERO_DIR
    _shape_zero3_tensors(universal, info or {})
    _link_both_names(zero, num_layers, tied, shared)
    if vocab_rows:
        fit_vocabulary_rows(zero, vocab_patterns, vocab_rows)
    state_file = zero / OPTIMIZER_STATE_FILE
    state = load_checkpoint_file(state_file)
    torch.save(_optimizer_state_for_every_stage(state, _any_step(zero)), state_file)
    _name_model_states_for_every_stage(universal)


def _shape_zero3_tensors(universal: Path, info: dict[str, Any]) -> None:
    """Give a ZeRO-3 conversion the files every other loader reads.

    ``ds_to_universal`` writes a ZeRO-3 checkpoint's tensors flat and bare (no ``{"param": ...}``,
    no shape, no split metadata) and its step only in ``optimizer_state.pt``; the ZeRO-1/2 loaders and
    :func:`load_into_torch_optimizer` need each tensor in its shape (to cut it over tp) and a
    ``step.pt`` per parameter. The shapes are the ones the ZeRO-3 model-state file records.

    DeepSpeed's ZeRO-1/2 universal loader cuts a tensor along its ``cat_dim`` (dim 0 when absent) and by
    its sub-parameter sections: without them a row-parallel weight (attention output, MLP output) reached
    a tp>1 run cut along the wrong dimension. So each tensor goes through DeepSpeed's own merge step at
    tp 1 with the checkpoint's ``info``, which writes the metadata ``ds_to_universal`` writes for ZeRO-1/2.
    """
    model_files = sorted(p for p in universal.iterdir() if (m := _ZERO3_MODEL_STATES.match(p.name)) and m.group(1) == "0")
    if not model_files:
        return
    state = _load(model_files[0])
    if int(state.get("mp_world_size") or 1) > 1:
        raise CheckpointError(f"{universal}: ZeRO-3 checkpoints saved with tensor parallelism cannot change layout")
    shapes = {name: shape for group in state.get("param_shapes") or [] for name, shape in group.items()}
    zero = universal / ZERO_DIR
    split_info = _with_tuple_shapes(info) if len(info) > 1 else None  # more than the version key
    slices = universal / "tmp_zero3_slices"
    step: Any = None
    for name, shape in shapes.items():
        folder = zero / name
        bare = False
        for key in STATE_FILES:
            path = folder / f"{key}.pt"
            value = _load(path)
            if isinstance(value, torch.Tensor):
                bare = True
                if split_info is None:
                    torch.save({"param": value.reshape(shape).clone()}, path)
                else:
                    fragment = slices / name / "0" / f"{key}.00"  # DeepSpeed's fragment naming, tp rank 0
                    fragment.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(value.flatten().clone(), fragment)
        if bare and split_info is not None:
            merge_universal_tp_slices(split_info, zero, slices, 1, name, [torch.Size(shape)])
        if not (folder / "step.pt").is_file():
            if step is None:
                inner = _load(zero / OPTIMIZER_STATE_FILE).get("optimizer_state_dict") or {}
                step = (inner.get("state") or {}).get(0, {}).get("step")
                if step is None:
                    raise CheckpointError(f"{zero / OPTIMIZER_STATE_FILE} records no optimizer step")
            torch.save(step, folder / "step.pt")
    shutil.rmtree(slices, ignore_errors=True)


def _link_both_names(zero: Path, num_layers: int, tied: bool, shared: frozenset[int]) -> None:
    """Each parameter's folder under its GPTModel name and its PipelineModule name (relative links)."""
    for folder in sorted(p for p in zero.iterdir() if p.is_dir() and not p.is_symlink()):
        canonical = model_parameter_name(folder.name) if is_pipeline_parameter_name(folder.name) else folder.name
        try:
            pipe = pipeline_parameter_name(canonical, num_layers, tied, shared)
        except ValueError:
            continue  # not a GPT parameter (nothing to rename)
        for alias in {canonical, pipe} - {folder.name}:
            link = zero / alias
            if not link.exists():
                link.symlink_to(folder.name, target_is_directory=True)


def _any_step(zero: Path) -> Any:
    for step_file in sorted(zero.glob("*/step.pt")):
        return load_checkpoint_file(step_file)
    return None


def _optimizer_state_for_every_stage(state: dict[str, Any], step: Any) -> dict[str, Any]:
    """The optimizer's global state in the shape both loaders read: ZeRO-1/2 and the bf16 optimizer
    take ``param_groups`` (one per group) and the loss-scaler entries from the top level, ZeRO-3
    takes the step and ``param_groups`` from ``optimizer_state_dict``."""
    out = dict(state)
    inner = dict(out.get(OPTIMIZER_STATE_DICT) or {})
    groups = out.get(PARAM_GROUPS) or inner.get(PARAM_GROUPS)
    if groups is None:
        raise CheckpointError("the universal checkpoint's optimizer_state.pt names no parameter groups")
    out[PARAM_GROUPS] = groups
    inner[PARAM_GROUPS] = groups
    if step is not None:
        inner["state"] = {0: {"step": step}}
    out[OPTIMIZER_STATE_DICT] = inner
    out.setdefault("ds_version", deepspeed.__version__)
    return out


def _name_model_states_for_every_stage(universal: Path) -> None:
    """ZeRO-3 engines look for ``zero_pp_rank_0_mp_rank_XX_model_states.pt``, the others for
    ``mp_rank_XX_model_states.pt``; each reads one of them (any one: they differ only in the
    source layout's bookkeeping) for the LR scheduler, step counters and client state. Every tp
    rank's file gets both names: DeepSpeed's loader counts the files it finds against the
    ``mp_world_size`` they record (a tp2 checkpoint linked once was refused at ZeRO-3)."""
    files = sorted(p.name for p in universal.iterdir() if p.is_file())
    plain = {int(m.group(1)): name for name in files if (m := _MODEL_STATES.match(name))}
    zero3 = {int(m.group(2)): name for name in files if (m := _ZERO3_MODEL_STATES.match(name)) and m.group(1) == "0"}
    if not plain and zero3:
        for mp_rank, name in zero3.items():
            os.link(universal / name, universal / f"mp_rank_{mp_rank:02d}_model_states.pt")
    if not zero3 and plain:
        for mp_rank, name in plain.items():
            os.link(universal / name, universal / f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt")


def fit_vocabulary_rows(zero: Path, patterns: list[str], rows: int) -> list[str]:
    """Trim or zero-pad the padded vocabulary of a universal checkpoint to ``rows``.

    The rows dropped or added are padding beyond the tokenizer's vocabulary, never real tokens.
    """
    changed: list[str] = []
    for param_dir in sorted(p for p in zero.iterdir() if p.is_dir() and not p.is_symlink()):
        if not any(re.match(p, param_dir.name) for p in patterns):
            continue
        for state_file in param_dir.glob("*.pt"):
            if state_file.name == "step.pt":
                continue
            state = load_checkpoint_file(state_file)
            have = state["param"].shape[0]
            if have > rows:
                state["param"] = state["param"][:rows].clone()
            elif have < rows:
                state["param"] = torch.nn.functional.pad(state["param"], (0, 0, 0, rows - have))
            else:
                continue
            torch.save(state, state_file)
            changed.append(f"{param_dir.name}/{state_file.name}")
    return changed


# --- ZeRO-0 targets ------------------------------------------------------------------------------------------------
def load_into_torch_optimizer(engine: Any, universal: Path, *, load_optimizer: bool, load_scheduler: bool) -> None:
    """Load ``universal`` into an engine without ZeRO whose optimizer is a bare torch optimizer.

    Weights go into the module (the fp32 master copy itself), moments and step into the optimizer
    through its own ``load_state_dict`` (which places them as the optimizer expects); the parameter
    groups' hyperparameters stay this run's (the LR scheduler sets the rate).
    """
    optimizer = plain_torch_optimizer(engine)
    assert optimizer is not None, "only for engines without ZeRO that train with a torch optimizer"
    zero = universal / ZERO_DIR

    def local(name: str, key: str, param: torch.Tensor) -> torch.Tensor:
        return _local_part(zero, name, key, param)

    position = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state_dict = optimizer.state_dict()
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            param.copy_(local(name, "fp32", param))
            if load_optimizer and id(param) in position:
                entry = {key: local(name, key, param) for key in ("exp_avg", "exp_avg_sq")}
                entry["step"] = torch.as_tensor(_load(zero / name / "step.pt"), dtype=torch.float32).clone()
                state_dict["state"][position[id(param)]] = entry
    if load_optimizer:
        optimizer.load_state_dict(state_dict)
    model_states = sorted(universal.glob("mp_rank_*_model_states.pt"))
    if model_states:
        counters = _load(model_states[0])
        if load_scheduler and engine.lr_scheduler is not None and counters.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
        if load_optimizer:
            restore_engine_counters(engine, counters)


def _local_part(zero: Path, name: str, key: str, param: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's part of ``zero/<name>/<key>.pt`` in ``param``'s shape and dtype, cut with the
    partition the parameter records (set by the tensor-parallel layers)."""
    tp_rank, tp = topology.get_tensor_model_parallel_rank(), topology.get_tensor_model_parallel_world_size()
    path = zero / name / f"{key}.pt"
    if not path.is_file() and key == "fp32" and not getattr(param, "requires_grad", True):
        raise CheckpointError(
            f"{path} is missing: {zero.parent} carries no copy of the frozen weight {name} (it was converted by a "
            "Deepy that left LoRA's frozen base out). Delete that directory and load again: it is converted anew")
    full = _load(path)["param"]
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        dim, sections = tensor_parallel_partition(param)
        full = shard_tensor(full, dim, tp_rank, tp, sections)
    if full.numel() != param.numel():
        raise CheckpointError(f"{path} holds {tuple(full.shape)} for a parameter of "
                              f"{tuple(param.shape)} on tensor-parallel rank {tp_rank} of {tp}")
    return full.reshape(param.shape).to(dtype=param.dtype)


# --- frozen weights (LoRA's base) ------------------------------------------------------------------------------
def write_frozen_parameters(ckpt_dir: Path, target: Path, meta: dict[str, Any]) -> list[str]:
    """Give the universal checkpoint ``target`` of ``ckpt_dir`` an ``fp32.pt`` for every weight outside the
    optimizer: a LoRA run's frozen base (``lora_r > 0``; no other run freezes weights). Returns their names.

    Both converters write the optimizer's parameters only (the adapters); the base is read here from the model
    files of every tp rank (plain or pipeline, either file layout) and merged with the recorded architecture's
    partitions, or for ZeRO-3 (whose model files hold placeholders) rebuilt by DeepSpeed's ``zero_to_fp32``.
    Stored in fp32 like every universal tensor (lossless for a bf16/fp16 base; loading casts back).
    """
    args = meta.get("args") or {}
    if int(args.get("lora_r") or 0) == 0 and SoftPromptSettings.of(args.get("soft_prompt_tuning")) is None:
        return []  # a soft prompt's run freezes every weight but the prompt, too
    layout = meta["layout"]
    tp, pipeline = int(layout["tp"]), bool(layout.get("pipeline", False))
    zero = target / ZERO_DIR
    held = {model_parameter_name(p.name) if is_pipeline_parameter_name(p.name) else p.name
            for p in zero.iterdir() if p.is_dir()}
    if int(layout["zero_stage"]) == 3:
        with weights_only_loading(ckpt_dir):
            full = dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name))
        frozen = {name: t for name, t in full.items() if name not in held and not computed_buffer(name)}
    else:
        names = NeoxNames.from_stored(args)
        shards: dict[str, list[torch.Tensor]] = defaultdict(list)
        for tp_rank in range(tp):
            for name, tensor in canonical_rank_weights(ckpt_dir, names, tp, tp_rank, pipeline).items():
                if name not in held and not computed_buffer(name):
                    shards[name].append(tensor)
        frozen = merge_tp_shards(stored_model_config(args), shards)
    for name, tensor in sorted(frozen.items()):
        (zero / name).mkdir(parents=True, exist_ok=True)
        torch.save({"param": tensor.detach().float().clone()}, zero / name / "fp32.pt")
    return sorted(frozen)


def load_frozen_parameters(engine: Any, universal: Path) -> int:
    """Load every frozen weight of ``engine``'s module (``requires_grad`` False: LoRA's base) from ``universal``,
    cut for this tensor-parallel rank; returns how many. For ZeRO-1/2/3 engines, whose universal loader fills the
    optimizer's parameters only; under ZeRO-3 the partitioned weights are gathered, written and partitioned again."""
    frozen = [(name, param) for name, param in engine.module.named_parameters() if not param.requires_grad]
    if not frozen:
        return 0
    zero = universal / ZERO_DIR
    with torch.no_grad(), _whole(engine, [param for _, param in frozen]):
        for name, param in frozen:
            param.copy_(_local_part(zero, name, "fp32", param))
    return len(frozen)


def _whole(engine: Any, params: list[torch.Tensor]) -> Any:
    """A context in which ZeRO-3's partitioned ``params`` are whole and what is written to them is kept
    (DeepSpeed's ``GatheredParameters``; every rank writes the same values). Nothing to do below stage 3."""
    if int(engine.zero_optimization_stage()) != 3:
        return contextlib.nullcontext()

    group = getattr(params[0], "ds_process_group", None)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    return deepspeed.zero.GatheredParameters(params, modifier_rank=source)
