"""The checkpoint a run starts from, checked against its config before launch.

``deepy.py`` (``--dry-run`` too) finds the checkpoint the ranks will load, as the checkpoint manager will
(``load``'s newest committed one or ``iteration``'s, a restart's own one in ``save``, the weights of
``initialize_from``/``finetune``), reads the arguments it recorded (``deepy_meta.json``) and refuses, naming
the key and where it was set, what the ranks would otherwise refuse only after launch, some of it after a
universal conversion:

* ``load`` or ``initialize_from`` holding no Deepy checkpoint (a Hugging Face model, incomplete saves, one
  ``global_stepN`` instead of its directory, other files) or no committed one for ``iteration``;
* ``save`` holding another run's checkpoints (its saves would be mixed with them);
* another architecture (:data:`SHAPE_KEYS`);
* other LoRA adapters (``lora_r``, ``lora_alpha``, ``lora_target_modules``), none where the checkpoint has
  some, or some where a resumed checkpoint has none;
* another LR schedule on resume (unless ``override_lr_scheduler`` or ``use_checkpoint_lr_scheduler``): the
  schedule's own comparison (``engine/lr_config.py``), handed to :func:`fit_problems`;
* a layout change Deepy cannot make, and a new objective head (a reward model from a language model)
  started from a checkpoint at another layout.

And a resume at another data-parallel size keeps the checkpoint's ``train_batch_size`` when the config leaves
it to be derived, by deriving the gradient accumulation instead (:func:`batch_across_layouts`, called by the
batch derivation), or refuses by name where it cannot.

Only files are read (listings, commit markers, JSON); no tensor, no torch. The ranks check the same again
when they load, so a checkpoint changed between the launch and the load is still refused.

Save schedule checks:
Before-launch checks of the checkpoint keys (``megatron/checkpointing/config.py``): a save directory
goes with a save schedule, and ``save_interval`` is a duration. Registered with every other check
(``megatron/config_rules.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron import object_store
from megatron.checkpointing import commit, discovery
from megatron.checkpointing.layout import Layout, check_convertible, needs_universal
from megatron.config_rules import RuleContext, describe, render, rule, zero_source, zero_stage
from megatron.data.config import PATH_KEYS
from megatron.errors import CheckpointError
from megatron.objective_needs import known_needs
from megatron.time_phrases import TimePhraseError, parse_duration

# Arguments that fix the shape of the weights: a checkpoint with other values cannot be loaded.
SHAPE_KEYS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
    "padded_vocab_size", "max_position_embeddings", "pos_emb", "norm", "activation",
    "num_experts", "no_weight_tying", "moe_num_experts", "moe_expert_interval",
)  # fmt: skip

LORA_KEYS = ("lora_r", "lora_alpha", "lora_target_modules")
"""The adapter keys a checkpoint with adapters must be continued with (``lora_dropout`` may change)."""


@dataclass(frozen=True)
class Start:
    """The checkpoint a run will load and how."""

    ckpt: Path
    meta: dict[str, Any]
    weights_only: bool
    """``initialize_from``/``finetune``: weights only, step 0."""
    key: str
    """The key that names it: ``load``, ``initialize_from``, or ``save`` for a restart of this run."""

    @property
    def args(self) -> dict[str, Any]:
        recorded = self.meta.get("args")
        return recorded if isinstance(recorded, dict) else {}

    @property
    def layout(self) -> Layout | None:
        try:
            return Layout.from_dict(self.meta["layout"])
        except (KeyError, TypeError, ValueError):
            return None


def _path(ctx: RuleContext, key: str) -> Path | None:
    value = ctx.get(key)
    return Path(str(value)) if value else None


def _same_dir(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _sources(ctx: RuleContext) -> dict[str, Any]:
    """What ``discovery.same_source`` compares: where this run starts from."""
    return {"load": ctx.get("load") if ctx.get("load_checkpoint") else None,
            "initialize_from": ctx.get("initialize_from"), "finetune": bool(ctx.get("finetune"))}


def _origin(ctx: RuleContext) -> tuple[Path | None, bool]:
    """The directory the run starts from and whether it starts from weights only; (None, False) for a fresh
    start. The same choice as ``CheckpointManager.load``."""
    load = _path(ctx, "load") if ctx.get("load_checkpoint") else None
    init = _path(ctx, "initialize_from")
    finetune = bool(ctx.get("finetune"))
    if load is not None and not finetune and discovery.inspect_load_dir(load).kind in ("deepy", "gpt_neox"):
        return load, False
    source = init or (load if finetune else None)
    return source, source is not None


def _restart(ctx: RuleContext, origin: Path) -> Start | None:
    """This run's own newest checkpoint in ``save`` when ``save`` is not ``origin`` (a restart resumes it)."""
    save = _path(ctx, "save")
    if save is None or _same_dir(save, origin):
        return None
    found = discovery.run_in_save(save, **_sources(ctx))
    if found is None or not discovery.same_source(found[1], **_sources(ctx)):
        return None
    point = discovery.resume_point(save, commit.step_of(found[0]))
    return Start(point[0], point[1], False, "save") if point is not None else None


def planned_start(ctx: RuleContext) -> Start | None:
    """The committed Deepy checkpoint the ranks will load; None for a fresh start, a GPT-NeoX checkpoint
    (no recorded arguments) or a source the ranks will refuse (:func:`start_problems` names it). The
    inference scripts read the weights of ``load``'s newest committed checkpoint (or ``iteration``'s)."""
    if not ctx.trains:
        load = _path(ctx, "load")
        point = discovery.resume_point(load, ctx.get("iteration")) if load is not None else None
        return Start(point[0], point[1], True, "load") if point is not None else None
    origin, weights_only = _origin(ctx)
    if origin is None or discovery.inspect_load_dir(origin).kind != "deepy":
        return None
    restart = _restart(ctx, origin)
    if restart is not None:
        return restart
    iteration = ctx.get("iteration") if (not weights_only or ctx.get("finetune")) else None
    point = discovery.resume_point(origin, iteration)
    if point is None:
        return None
    key = "initialize_from" if weights_only and ctx.get("initialize_from") else "load"
    return Start(point[0], point[1], weights_only, key)


def _explain(ctx: RuleContext, found: discovery.Found, key: str) -> str:
    return discovery.explain(found, ctx.tp, ctx.pipe_parallel_size, key, shown=ctx.show(key))


def start_problems(ctx: RuleContext) -> list[str]:
    """``load``/``initialize_from`` that hold nothing the run can start from, a missing ``iteration``, and a
    ``save`` directory with another run's checkpoints."""
    if not ctx.trains:
        return _inference_source_problems(ctx)
    problems: list[str] = []
    load = _path(ctx, "load") if ctx.get("load_checkpoint") else None
    save = _path(ctx, "save")
    finetune = bool(ctx.get("finetune"))
    if load is not None:
        found = discovery.inspect_load_dir(load)
        first_run = found.kind in ("missing", "empty") and ((save is not None and _same_dir(save, load)) or finetune)
        if found.kind not in ("deepy", "gpt_neox") and not first_run:
            problems.append(_explain(ctx, found, "load"))
    origin, weights_only = _origin(ctx)
    if finetune and origin is None:  # CheckpointManager._initialize refuses it on the ranks
        problems.append(f"{ctx.show('finetune')} starts from the weights of a checkpoint, and neither load nor "
                        "initialize_from names one: set load (or initialize_from) to its directory, or remove finetune")
    if origin is not None and weights_only and not problems:
        found = discovery.inspect_load_dir(origin)
        if found.kind not in ("deepy", "gpt_neox") and _restart(ctx, origin) is None:
            problems.append(_explain(ctx, found, "initialize_from" if ctx.get("initialize_from") else "load"))
    iteration = ctx.get("iteration")
    if origin is not None and iteration is not None and (not weights_only or finetune):
        problems += _iteration_problems(ctx, origin, int(iteration))
    return problems + _save_problems(ctx, origin, save)


def _inference_source_problems(ctx: RuleContext) -> list[str]:
    """generate.py and eval.py read the weights of a committed Deepy checkpoint in ``load``."""
    load = _path(ctx, "load")
    if load is None:
        return []  # they say so themselves: they need `load`
    found = discovery.inspect_load_dir(load)
    if found.kind != "deepy":
        return [_explain(ctx, found, "load")]
    iteration = ctx.get("iteration")
    return _iteration_problems(ctx, load, int(iteration)) if iteration is not None else []


def _iteration_problems(ctx: RuleContext, directory: Path, iteration: int) -> list[str]:
    if discovery.inspect_load_dir(directory).kind != "deepy" or _restart(ctx, directory) is not None \
            or commit.is_committed(directory / commit.tag_for(iteration)):
        return []
    steps = ", ".join(map(str, commit.list_checkpoints(directory).steps)) or "none"
    return [f"{ctx.show('iteration')}: {directory} holds no committed checkpoint for iteration {iteration}; "
            f"committed iterations: {steps}"]


def _save_problems(ctx: RuleContext, origin: Path | None, save: Path | None) -> list[str]:
    if save is None:
        return []
    found = discovery.inspect_load_dir(save)
    if found.kind in ("gpt_neox", "hf_model"):
        what = "a GPT-NeoX checkpoint" if found.kind == "gpt_neox" else "a Hugging Face model"
        if origin is None or not _same_dir(origin, save):
            return [f"{ctx.show('save')} holds {what}; writing Deepy checkpoints there would replace its files (and "
                    "its `latest`). Save to another directory."]
        return []
    if origin is not None and _same_dir(origin, save):
        return []
    held = discovery.run_in_save(save, **_sources(ctx))
    if held is None:
        return []
    tag, recorded = held
    if origin is None:
        steps = ", ".join(map(str, commit.list_checkpoints(save).steps[-5:]))
        load = ctx.get("load")
        if load and not ctx.get("load_checkpoint"):
            why = f"{ctx.show('load_checkpoint')}"
        else:
            why = "no load"
        return [f"{ctx.show('save')} already holds committed checkpoints ({steps}) and this run starts fresh ({why}): "
                f"its checkpoints would collide with them. Save to a new directory, remove the old checkpoints, or "
                f"set load: {save} to resume them."]
    if discovery.same_source(recorded, **_sources(ctx)):
        return []  # a restart: the run resumes its own newest checkpoint there
    return [discovery.foreign_run_message(save, tag, recorded, f"starts from {origin}", shown=ctx.show("save"))]


# --- what the checkpoint recorded, against the config ------------------------------------------------------
def _declared(ctx: RuleContext, key: str) -> bool:
    return key in getattr(type(ctx.args), "model_fields", {})


def shape_problems(ctx: RuleContext, start: Start) -> list[str]:
    """Architecture keys whose value differs from the checkpoint's (the padded vocabulary is compared by the
    ranks, which know the tokenizer's size)."""
    recorded = start.args
    return [
        f"{ctx.show(key)}: {start.ckpt} was saved with {key} {render(recorded[key])}; the weights cannot be "
        f"loaded into another shape (set {key}: {render(recorded[key])})"
        for key in SHAPE_KEYS
        if key != "padded_vocab_size" and key in recorded and _declared(ctx, key) and recorded[key] != ctx.get(key)
    ]


def lora_problems(ctx: RuleContext, start: Start) -> list[str]:
    """The adapters of the checkpoint against the config's (``megatron/checkpointing/new_parameters.py`` loads them)."""
    recorded = start.args
    saved_r, r = int(recorded.get("lora_r") or 0), int(ctx.get("lora_r") or 0)
    if saved_r == 0 and r == 0:
        return []
    if saved_r == 0:
        if start.weights_only:
            return []  # the checkpoint becomes the frozen base of the adapters
        return [f"{ctx.show('lora_r')}: {start.ckpt} holds no LoRA adapters (it was saved with lora_r 0) and this run "
                f"trains adapters: start from it as the frozen base with initialize_from: {start.ckpt.parent} (or "
                "finetune: true), and save the adapter run to another directory"]
    settings = ", ".join(f"{key} {render(recorded.get(key))}" for key in LORA_KEYS)
    if r == 0:
        if start.weights_only:
            return []  # merging the adapters into full weights is the objective's business
        return [f"{ctx.show('lora_r')}: {start.ckpt} holds LoRA adapters ({settings}); resuming it needs the same "
                f"adapters: set {', '.join(f'{key}: {render(recorded.get(key))}' for key in LORA_KEYS)}"]
    differ = [key for key in LORA_KEYS if key in recorded and recorded[key] != ctx.get(key)]
    return [f"{ctx.show(key)}: {start.ckpt} was trained with {key} {render(recorded[key])} ({settings}); its "
            f"adapters {'load' if start.weights_only else 'resume'} only with the same value (set {key}: "
            f"{render(recorded[key])})" for key in differ]


def planned_layout(ctx: RuleContext) -> Layout | None:
    """The layout the ranks will have (``current_layout`` on a rank), from the resolved keys."""
    dp = ctx.dp
    if dp is None:
        return None
    pipe = ctx.pipe_parallel_size
    replicas = 1
    if ctx.get("sharding_strategy") == "hsdp" and ctx.get("sharding_group_size"):
        replicas = max(dp // int(ctx.get("sharding_group_size")), 1)
    return Layout(tp=ctx.tp, pp=max(pipe, 1), dp=dp, zero_stage=zero_stage(ctx), pipeline=pipe >= 1,
                  replicas=replicas)


def layout_problems(ctx: RuleContext, start: Start) -> list[str]:
    """A layout change the ranks cannot make, and a new objective head across a layout change."""
    saved, planned = start.layout, planned_layout(ctx)
    keys = ", ".join(ctx.show(key) for key in ("model_parallel_size", "pipe_parallel_size"))
    if saved is None or planned is None:
        return []
    if start.meta.get("weights_only"):  # written by a converter for one tp/pp (save_load._load_weights_only)
        if (saved.tp, saved.pp, saved.pipeline) != (planned.tp, planned.pp, planned.pipeline):
            return [f"{keys}: {start.ckpt} holds weights only, written for model_parallel_size {saved.tp} and "
                    f"pipe_parallel_size {saved.pp if saved.pipeline else 0}; run with those, or convert its source "
                    "again with --tp/--pp for this run"]
        return []
    if not needs_universal(saved, planned):
        return []
    try:
        check_convertible(saved, planned, moe=int(ctx.get("moe_num_experts") or 1) > 1)
    except CheckpointError as err:
        return [f"{keys}, {ctx.show('zero_optimization')}: {err.message}"]
    if planned.zero_stage == 0 and ctx.get("precision") not in (None, "fp32"):
        return [f"{ctx.show('precision')} without ZeRO: {start.ckpt} was saved at {saved}, this run is at {planned}; "
                "without ZeRO only fp32 runs can change layout (DeepSpeed's fp16/bf16 optimizers keep their own "
                "layout there). Use zero_optimization.stage 1, or load at the saved layout"]
    recorded = start.args
    if saved.zero_stage == 0 and recorded.get("precision") not in (None, "fp32"):
        return [f"{keys}: {start.ckpt} was saved without ZeRO by a {recorded.get('precision')} run, whose optimizer "
                f"state cannot change layout ({saved} -> {planned}); resume it at the saved layout"]
    impl, saved_impl = ctx.get("train_impl"), recorded.get("train_impl")
    needs = known_needs(str(impl))
    if start.weights_only and needs is not None and needs.value_head and saved_impl != impl:
        return [f"{ctx.show('train_impl')}: {start.ckpt} was saved by a {saved_impl!r} run at {saved}; starting a "
                f"{impl!r} model (a new scalar head) from it needs the same layout ({planned} here): set {keys} "
                "to the checkpoint's, or save the checkpoint at this layout first"]
    return []


FitCheck = Callable[[RuleContext, Start], list[str]]
"""A comparison of what a checkpoint recorded with the config: ``(ctx, start) -> problems``."""


def fit_problems(ctx: RuleContext, start: Start, *, schedule: FitCheck) -> list[str]:
    """Everything in the checkpoint's recorded arguments this config contradicts (for generate.py and eval.py,
    which read the weights whole and take the adapters from the checkpoint: the architecture only).
    ``schedule`` compares the LR schedules; it belongs to the schedule (``engine/lr_config.py``:
    ``schedule_problems``, above this package), so the argument layer hands it in."""
    if not ctx.trains:
        return shape_problems(ctx, start)
    return [*shape_problems(ctx, start), *lora_problems(ctx, start), *schedule(ctx, start),
            *layout_problems(ctx, start), *optimizer_state_problems(ctx, start)]


def optimizer_state_problems(ctx: RuleContext, start: Start) -> list[str]:
    """A checkpoint saved with ``no_save_optim`` resumed exactly, or at another layout (the ranks refuse the same
    in ``save_load._load_checkpoint``)."""
    saved, planned = start.layout, planned_layout(ctx)
    changes = saved is not None and planned is not None and needs_universal(saved, planned)
    problem = discovery.unsaved_optimizer_problem(start.meta, changes, start.weights_only,
                                                  load_optim=not ctx.get("no_load_optim"))
    return [] if problem is None else [f"{start.key} ({describe(ctx.source(start.key))}): {start.ckpt}: {problem}"]


@rule
def no_save_optim_keeps_the_weights(ctx: RuleContext) -> list[str]:
    """Under ZeRO-3 the module's weights live in the ZeRO files ``no_save_optim`` leaves out (the model-states file
    holds empty placeholders), so its checkpoints would hold no weights at all."""
    if ctx.get("no_save_optim") and zero_stage(ctx) == 3:
        return [f"{ctx.show('no_save_optim')} with ZeRO stage 3 ({zero_source(ctx)}): ZeRO-3 keeps the weights "
                f"themselves in the optimizer files no_save_optim leaves out; use ZeRO stage 1 or 2, or save the "
                f"optimizer state"]
    return []


# --- the global batch across a layout change --------------------------------------------------------------
def _saved_dp(start: Start) -> int | None:
    recorded = start.args
    world = start.meta.get("world_size")
    split = int(recorded.get("model_parallel_size") or 1) * max(int(recorded.get("pipe_parallel_size") or 0), 1) \
        * int(recorded.get("context_parallel_size") or 1)
    return int(world) // split if isinstance(world, int) and split else None


def batch_across_layouts(ctx: RuleContext, dp: int, micro: int | None, micro_key: str,
                         gas: int | None) -> tuple[int | None, list[str]]:
    """``(train_batch_size, problems)`` for a resume at another data-parallel size whose config leaves
    ``train_batch_size`` to be derived: the checkpoint's, so ``micro x accumulation x dp`` keeps the global batch
    (and with it the data position and the schedule of samples). ``(None, [])`` when nothing is to keep."""
    start = planned_start(ctx)
    if start is None or start.weights_only or micro is None:
        return None, []
    saved_total, saved_dp = start.args.get("train_batch_size"), _saved_dp(start)
    if not isinstance(saved_total, int) or saved_dp is None or saved_dp == dp:
        return None, []
    what = (f"resuming {start.ckpt} (train_batch_size {saved_total} at data-parallel size {saved_dp}) at "
            f"data-parallel size {dp}")
    if gas is not None:
        if micro * gas * dp == saved_total:
            return None, []
        return None, [f"{ctx.show(micro_key)}, {ctx.show('gradient_accumulation_steps')}: {what} would change the "
                      f"global batch to {micro * gas * dp}. Set train_batch_size: {saved_total} (the accumulation is "
                      f"then derived) to keep it, or train_batch_size: {micro * gas * dp} to change it on purpose"]
    if saved_total % (micro * dp):
        return None, [f"{ctx.show(micro_key)}: {what} cannot keep the global batch ({saved_total} is not a multiple "
                      f"of {micro} x {dp}). Choose a micro batch that divides it, or set train_batch_size to change "
                      "it on purpose"]
    ctx.warnings.append(f"{what}: train_batch_size {saved_total} kept, gradient_accumulation_steps "
                        f"{saved_total // (micro * dp)} derived (set train_batch_size to change the global batch)")
    return saved_total, []


# --- Save schedule checks ------------------------------------------------------------------------
SAVE_SCHEDULE_KEYS = ("checkpoint_factor", "extra_save_iters", "save_interval", "keep")


@rule
def save_has_schedule(ctx: RuleContext) -> list[str]:
    scheduled = [key for key in SAVE_SCHEDULE_KEYS if ctx.get(key) not in (None, [], "")]
    if ctx.get("save") and not scheduled:
        return [
            f"{ctx.show('save')} but no save schedule: add checkpoint_factor (save every N steps), "
            f"extra_save_iters, save_interval (e.g. 15min) or keep"
        ]
    if scheduled and not ctx.get("save"):
        shown = ", ".join(ctx.show(key) for key in scheduled)
        return [f"{shown} but save (the checkpoint directory) is not set: add save: <dir> or remove them"]
    return []


@rule
def save_interval_is_duration(ctx: RuleContext) -> list[str]:
    value = ctx.get("save_interval")
    if value is None:
        return []
    try:
        parse_duration(value)
    except TimePhraseError as err:
        return [f"{ctx.show('save_interval')}: {err}"]
    return []


OBJECT_STORE_KEYS = {"save": True, "load": False, "s3_path": True, "hf_save_path": True, "lora_peft_save_path": True}
"""The checkpoint keys that may name an object store, and whether the run writes there."""


@rule
def object_store_paths_usable(ctx: RuleContext) -> list[str]:
    """A ``scheme://`` path is a bucket, never a local directory: refused unless Deepy can write (or read) it, and
    its bucket is probed with the standard credentials (``megatron/object_store.py``); ``initialize_from`` in a
    bucket is not read (copy it here first)."""
    problems = []
    for key, write in OBJECT_STORE_KEYS.items():
        value = ctx.get(key)
        if value and object_store.is_remote(str(value)):
            try:
                object_store.check_url(key, str(value), describe(ctx.source(key)), write=write)
            except object_store.StoreError as err:
                problems.append(str(err))
    origin = ctx.get("initialize_from")
    if origin and object_store.is_remote(str(origin)):
        problems.append(f"{ctx.show('initialize_from')}: starting weights are read from a local directory; copy "
                        f"{origin} to this machine (or set load: {origin} with finetune: true)")
    problems += _local_only_urls(ctx)
    if ctx.get("s3_path") and not ctx.get("save"):
        problems.append(f"{ctx.show('s3_path')} uploads the checkpoints of `save`, which is not set")
    if ctx.get("s3_path") and object_store.is_remote(str(ctx.get("save") or "")):
        problems.append(f"{ctx.show('s3_path')} with {ctx.show('save')}: `save` is already in object storage; "
                        "drop s3_path")
    return problems


LOCAL_SUFFIXES = ("_path", "_paths", "_dir", "_file", "_urls")
"""Keys named so hold paths; any of them not handled elsewhere must be a local one."""
ELSEWHERE = ("save", "load", "s3_path", "initialize_from", "hf_save_path", "lora_peft_save_path", "data_path",
             "train_urls", "validation_urls")
"""Keys whose object-store paths are checked by their own rule (above, and the data's in ``megatron/data/checks.py``)."""


def _local_only_urls(ctx: RuleContext) -> list[str]:
    """A ``scheme://`` value in a path key Deepy reads or writes only locally (``hf_save_path``, ``log_dir``, a
    tokenizer's ``vocab_file``, ...): without this it would be written as a local directory named ``s3:``."""
    problems = []
    for key in sorted(type(ctx.args).model_fields):
        if not key.endswith(LOCAL_SUFFIXES) or key in ELSEWHERE or key in PATH_KEYS:
            continue
        value = ctx.get(key)
        values = value if isinstance(value, list) else [value]
        remote = [v for v in values if isinstance(v, str) and object_store.is_remote(v)]
        if remote:
            problems.append(f"{ctx.show(key)}: {remote[0]} is in object storage, and {key} is read and written as a "
                            "local path only; give a local path (object storage is taken by save, load, s3_path and "
                            "the data paths)")
    return problems
