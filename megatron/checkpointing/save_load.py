"""Saving and loading a training checkpoint through the DeepSpeed engine.

One checkpoint directory ``<save>/global_step<N>/`` holds

* DeepSpeed's files (model, ZeRO optimizer shards, LR scheduler) plus our ``client_state``
  (``"deepy"``: iteration, consumed samples, layout; without ZeRO also the module name of every
  optimizer entry, which a torch optimizer state dict only numbers, so a later run can reshard it);
* ``deepy_rng/rank_<r>.pt``: each rank's RNG streams (python, numpy, torch, tensor-parallel);
* ``deepy_meta.json``: iteration, consumed samples, layout, the resolved arguments - readable
  without torch, so a load can decide whether to convert before touching any tensor;
* ``configs/resolved.yml``: every key of the run with its resolved value, for GPT-NeoX's tools
  (``neox/record.py``; the files' original text is in ``deepy_meta.json``);
* ``COMMITTED``: written last (see ``commit.py``).

Every rank takes part in every collective whatever happens to its own writes: file errors are
caught, all ranks agree on the outcome with an all-reduce, and only then everybody raises the same
``CheckpointError``. So a full disk stops the run loudly instead of hanging it, and the previous
checkpoint - the one ``latest`` points to - is never touched.

Random-number-generator state: each rank's, as plain tensors and numbers. Everything is converted to tensors, ints and lists so the file loads with
``torch.load(weights_only=True)``: no pickled numpy or Python objects, hence no code execution
from a checkpoint someone handed you.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron import mpu
from megatron.checkpointing import commit, reshard
from megatron.checkpointing.discovery import OPTIMIZER_SAVED_KEY, unsaved_optimizer_problem
from megatron.checkpointing.background_writes import BackgroundWrites
from megatron.checkpointing.commit import CheckpointKind
from megatron.checkpointing.expert_shards import check_expert_layout, load_expert_shards, save_expert_shards
from megatron.checkpointing.neox import config_files as neox_config_files
from megatron.checkpointing.neox import NeoxNames, canonical_rank_weights, neox_checkpoint_args
from megatron.checkpointing.new_parameters import base_checkpoint_loading, base_for_adapters, tolerating_new_parameters
from megatron.checkpointing.partitioned_load import load_whole_files
from megatron.checkpointing.preemption import collective_device
from megatron.checkpointing.resume_checks import SHAPE_KEYS
from megatron.checkpointing.safe_load import load_trusted_tensors, weights_only_loading
from megatron.checkpointing.universal import (
    Layout,
    check_convertible,
    conversion_dir,
    needs_universal,
    prepare_universal,
)
from megatron.deepspeed_internals import (
    recorded_checkpoint_writes,
    universal_loading,
    untie_optimizer_steps,
    without_optimizer_state,
)
from megatron.errors import CheckpointError
from megatron.mpu import hybrid_shard, topology
from megatron.mpu.random import get_rng_tracker
from megatron.mpu.topology import rank0_decides

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks

META_FILE = "deepy_meta.json"
RNG_DIR = "deepy_rng"
CONFIGS_DIR = "configs"
CLIENT_KEY = "deepy"
WEIGHTS_ONLY_KEY = "weights_only"
"""``deepy_meta.json`` flag of a converted checkpoint: module weights only, no optimizer or RNG files."""
FORMAT_VERSION = 3
"""3: model files in GPT-NeoX's current layout (``neox/layout.py``); 2: in its mid-2024 layout; 1: Deepy's
first layout. All are read (``neox.files.GQA_ORDER_OF_FORMAT``)."""
READABLE_FORMATS = (1, 2, 3)


BeforeCommit = Callable[[int], None]
"""Called with the step on every rank after all files are written and before the commit marker
(the crash-safety tests inject one that kills the process there)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def failed_ranks(failed: bool, group: Any = None) -> list[int]:
    """All-gather of "did my part fail", via one all-reduce (also a barrier). ``group``: a gloo group of
    every rank (a background save's), else the default group."""
    flags = torch.zeros(_world(), dtype=torch.int32)
    flags[_rank()] = int(failed)
    if dist.is_initialized():
        if group is None:
            flags = flags.to(collective_device())
        dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.cpu().tolist()) if f]


def _raise_if_failed(ckpt_dir: Path, error: BaseException | None, group: Any = None, doing: str = "saving") -> None:
    """Every rank learns whether any rank failed to write its part of ``ckpt_dir``, and all raise together."""
    failed = failed_ranks(error is not None, group)
    if failed:
        reason = f"{type(error).__name__}: {error}" if error else f"see the log of rank {failed[0]}"
        raise CheckpointError(
            f"{doing} checkpoint {ckpt_dir} failed on rank(s) {failed} ({reason}); it was not committed "
            "and the previous checkpoint is untouched. Training stops here: free space or fix "
            "permissions, then resume."
        )


@dataclass(frozen=True)
class SaveRequest:
    """What to write besides the engine's own state."""

    step: int
    consumed_samples: int
    kind: CheckpointKind
    layout: Layout
    args: dict[str, Any]
    config_files: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    save_rng: bool = True
    universal_info: dict[str, Any] | None = None
    """DeepSpeed's ``universal_checkpoint_info`` (TP patterns), needed to change tp later."""
    before_commit: BeforeCommit | None = None
    rank_files: tuple[Callable[[Path], None], ...] = ()
    """Other components' files (the weight average): each is called on every rank with the checkpoint
    directory after the engine's files are written and before the commit, and writes what its rank owns."""
    save_optim: bool = True
    """Write the optimizer and LR-scheduler state (False: ``no_save_optim``, the module's weights only)."""
    keep_existing: bool = False
    """A committed checkpoint of this step already on disk is this very state (the one the run resumed
    from, saved again when preempted at once): keep it. Otherwise one on disk is another trajectory's
    (a rewind with ``iteration``) and is replaced."""


def current_layout(engine: Any) -> Layout:
    return Layout(
        tp=topology.get_tensor_model_parallel_world_size(),
        pp=topology.get_pipe_parallel_world_size(),
        dp=topology.get_data_parallel_world_size(),
        zero_stage=int(engine.zero_optimization_stage()),
        pipeline=isinstance(engine, PipelineEngine),
        replicas=hybrid_shard.get_replica_world_size(),
    )


def save_checkpoint(engine: Any, save_dir: str | os.PathLike[str], request: SaveRequest) -> Path | None:
    """Write and commit one checkpoint on every rank. Returns its path (None if it was kept, see
    ``SaveRequest.keep_existing``).

    A committed checkpoint of the same step from another trajectory is replaced, never skipped: the new
    one is written beside it (``<tag>.replacing``) and swapped in once committed, so a crash while
    writing leaves the old one in place. Raises :class:`CheckpointError` on every rank if any rank failed
    to write its part.
    """
    pending = write_checkpoint(engine, save_dir, request)
    return None if pending is None else commit_checkpoint(pending)


@dataclass
class PendingSave:
    """A checkpoint whose files this rank has written (or handed to ``writes``), not yet committed."""

    save: Path
    request: SaveRequest
    ckpt_dir: Path
    """Where the files go: the final directory, or ``<tag>.replacing`` beside a committed one of another trajectory."""
    replacing: bool
    started: float
    writes: BackgroundWrites | None = None
    """The engine's files, serialized in memory and written by a thread (``async_save``); None: on disk already."""

    @property
    def final_dir(self) -> Path:
        return self.save / commit.tag_for(self.request.step)


def write_checkpoint(engine: Any, save_dir: str | os.PathLike[str], request: SaveRequest,
                     background: bool = False) -> PendingSave | None:
    """Every rank's files of one checkpoint (``background``: the engine's files go to a thread of their own,
    see ``background_writes.py``); nothing is committed. None: the checkpoint is kept (``keep_existing``)."""
    save = Path(save_dir)
    tag = commit.tag_for(request.step)
    final_dir = save / tag
    rank = _rank()
    # rank 0's disk decides (a rank that read its own could write under another name, or return here alone while
    # the others wait in the save's all-reduce)
    replacing = rank0_decides(commit.is_committed(final_dir) if rank == 0 else False)
    if replacing and request.keep_existing:
        # preempted right after resuming: the same state is already on disk, and deleting it to
        # write it again would leave a window with no checkpoint at all
        return None
    ckpt_dir = save / (tag + commit.REPLACING_SUFFIX) if replacing else final_dir
    written_tag = ckpt_dir.name

    started = time.monotonic()
    error: BaseException | None = None
    if rank == 0:
        try:
            save.mkdir(parents=True, exist_ok=True)
            if ckpt_dir.exists() and replacing:  # a replacement left over by a crash
                shutil.rmtree(ckpt_dir)
            elif ckpt_dir.exists():  # left over by a crash before its marker
                commit.remove_checkpoint(save, request.step)
        except OSError as err:
            error = err
    failed = failed_ranks(error is not None)
    if failed:
        raise CheckpointError(f"cannot prepare checkpoint directory {ckpt_dir}: {error or 'failed on rank 0'}")

    client_state: dict[str, Any] = {
        # what GPT-NeoX's own loader and tools read from mp_rank_XX_model_states.pt
        "iteration": request.step,
        "args": neox_checkpoint_args(request.args),
        CLIENT_KEY: {
            "format": FORMAT_VERSION,
            "iteration": request.step,
            "consumed_samples": request.consumed_samples,
            "layout": request.layout.to_dict(),
            "extra": request.extra,
        }
    }
    names = reshard.optimizer_param_names(engine)
    if names is not None:
        client_state[CLIENT_KEY][reshard.OPTIMIZER_PARAMS_KEY] = names
    if request.universal_info is not None:
        client_state["universal_checkpoint_info"] = request.universal_info
    writes = BackgroundWrites() if background else None
    with contextlib.ExitStack() as stack:
        if writes is not None:
            stack.enter_context(writes.capturing(engine))
        write_errors = stack.enter_context(recorded_checkpoint_writes(engine))
        if not request.save_optim:
            stack.enter_context(without_optimizer_state(engine))
        engine.save_checkpoint(str(save), written_tag, client_state=client_state, save_latest=False)
    error = write_errors[0] if write_errors else None
    # the ranks agree before the files of their own: the expert shards and the components' files (the weight
    # average) gather across ranks, and a rank whose engine files failed would not join them
    _raise_if_failed(ckpt_dir, error)
    try:
        _write_rank_files(ckpt_dir, request, rank)
        save_expert_shards(engine, ckpt_dir, request.save_optim)  # experts split over data-parallel ranks, if any
        for write in request.rank_files:
            write(ckpt_dir)
    except Exception as err:  # noqa: BLE001
        error = err
    _raise_if_failed(ckpt_dir, error)
    if writes is not None:
        writes.start(f"step {request.step}")
    return PendingSave(save, request, ckpt_dir, replacing, started, writes)


def commit_checkpoint(pending: PendingSave, group: Any = None, after_commit: Sequence[Callable[[], None]] = ()) -> Path:
    """Wait for this rank's background files (if any), agree with every rank that all were written and verified,
    then seal the checkpoint: the commit marker, the swap of a replacement, ``latest``. ``group``: the process
    group of the agreements (a background save's own, so its collectives never meet the training loop's);
    ``after_commit``: steps run on every rank once sealed, each followed by an agreement (the upload to object
    storage, then its remote commit marker)."""
    request, ckpt_dir, rank = pending.request, pending.ckpt_dir, _rank()
    error = pending.writes.wait() if pending.writes is not None else None
    _raise_if_failed(ckpt_dir, error, group)

    if request.before_commit is not None:
        request.before_commit(request.step)

    # every rank has finished writing (the all-reduce above is the barrier): seal it
    if rank == 0:
        try:
            commit.write_commit_marker(ckpt_dir, commit.CommitInfo(request.step, request.kind, time.time()))
            if pending.replacing:
                commit.replace_checkpoint(pending.save, request.step, ckpt_dir)
            commit.write_latest(pending.save, commit.tag_for(request.step))
        except OSError as err:
            error = err
    failed = failed_ranks(error is not None, group)
    if failed:
        raise CheckpointError(f"committing checkpoint {pending.final_dir} failed: {error or 'see the log of rank 0'}")
    for step in after_commit:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - every rank raises together below
            error = err
        failed = failed_ranks(error is not None, group)
        if failed:
            reason = f"{type(error).__name__}: {error}" if error else f"see the log of rank {failed[0]}"
            raise CheckpointError(f"uploading checkpoint {pending.final_dir} failed on rank(s) {failed} ({reason}); "
                                  "it is committed locally, not in the object store, whose previous checkpoint stays "
                                  "current. Training stops here: check the store, then resume.")
    if rank == 0:
        log.info("saved %s checkpoint %s in %.1fs%s", request.kind, pending.final_dir, time.monotonic() - pending.started,
                 " (replacing the one of another trajectory at this step)" if pending.replacing else "")
    return pending.final_dir


def _write_rank_files(ckpt_dir: Path, request: SaveRequest, rank: int) -> None:
    if request.save_rng:
        rng_dir = ckpt_dir / RNG_DIR
        rng_dir.mkdir(parents=True, exist_ok=True)
        torch.save(capture_rng_state(), rng_dir / f"rank_{rank:05d}.pt")
    if rank != 0:
        return
    meta = {
        "format": FORMAT_VERSION,
        "iteration": request.step,
        "consumed_samples": request.consumed_samples,
        "kind": request.kind,
        "layout": request.layout.to_dict(),
        "world_size": _world(),
        "extra": request.extra,
        "universal_info": request.universal_info,
        OPTIMIZER_SAVED_KEY: request.save_optim,
        "args": request.args,
    }
    (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=1, default=str), encoding="utf-8")
    configs = ckpt_dir / CONFIGS_DIR
    configs.mkdir(exist_ok=True)
    for name, text in neox_config_files(request.args).items():
        (configs / name).write_text(text, encoding="utf-8")


# --- loading ---------------------------------------------------------------------------------
@dataclass
class LoadResult:
    """What a load restored; ``loaded`` is False for a fresh start."""

    loaded: bool
    path: Path | None = None
    iteration: int = 0
    consumed_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rng_restored: bool = False
    """Every rank's RNG streams continue from the checkpoint (same tp/pp/dp split)."""


@dataclass(frozen=True)
class LoadOptions:
    weights_only: bool = False
    """Fine-tune / initialize-from: module weights only, fresh optimizer, step 0."""
    load_optim: bool = True
    load_rng: bool = True
    new_parameters: tuple[str, ...] = ()
    """``GPTModel`` name prefixes the objective adds to the checkpoint's model (a reward model's
    ``value_head.``): with ``weights_only`` they may be missing and start from their initialisation."""
    save_dir: Path | None = None
    """The loading run's ``save``: a conversion for another layout is written there (or, without one, to a
    temporary directory), never beside the checkpoint loaded (``universal.conversion_dir``)."""


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / META_FILE
    try:
        meta: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{ckpt_dir} has no {META_FILE}: it was not written by Deepy") from err
    except ValueError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{ckpt_dir} has checkpoint format {meta.get('format')}; this Deepy reads "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    return meta


def resolve_tag(load_dir: Path, iteration: int | None) -> tuple[str | None, list[str]]:
    """The committed tag to load: ``iteration`` if given (must exist), else the newest committed."""
    if iteration is not None:
        tag = commit.tag_for(iteration)
        if commit.is_committed(load_dir / tag):
            return tag, []
        listing = commit.list_checkpoints(load_dir)
        available = ", ".join(map(str, listing.steps)) or "none"
        raise CheckpointError(
            f"no committed checkpoint for iteration {iteration} in {load_dir}; committed iterations: {available}"
            + (f" (incomplete, skipped: {', '.join(listing.incomplete)})" if listing.incomplete else "")
        )
    return commit.newest_committed(load_dir)


def shape_mismatches(saved_args: dict[str, Any], args: dict[str, Any], same_tp: bool = True) -> list[str]:
    # the padded vocabulary grows with tp (rows are padded to a multiple of 128*tp): across a tp
    # change only the real rows must agree, and the universal loader re-pads them
    keys = [k for k in SHAPE_KEYS if same_tp or k != "padded_vocab_size"]
    return [
        f"{key}: checkpoint {saved_args.get(key)!r}, config {args.get(key)!r}"
        for key in keys
        if key in saved_args and key in args and saved_args[key] != args[key]
    ]


def load_checkpoint(
    engine: Any,
    ckpt_dir: Path,
    args: dict[str, Any],
    options: LoadOptions = LoadOptions(),
) -> LoadResult:
    """Load ``ckpt_dir`` (a committed checkpoint) into ``engine`` on every rank."""
    meta = read_meta(ckpt_dir)
    saved = Layout.from_dict(meta["layout"])
    layout = current_layout(engine)
    mismatched = shape_mismatches(meta.get("args", {}), args, same_tp=saved.tp == layout.tp)
    if mismatched:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved for another model shape:\n  " + "\n  ".join(mismatched)
        )
    check_expert_layout(meta.get("args", {}), args, ckpt_dir)
    with base_checkpoint_loading(engine, ckpt_dir, meta.get("args", {}), args, options.weights_only):
        return _load_checkpoint(engine, ckpt_dir, args, options, meta, saved, layout)


def _load_checkpoint(engine: Any, ckpt_dir: Path, args: dict[str, Any], options: LoadOptions,
                     meta: dict[str, Any], saved: Layout, layout: Layout) -> LoadResult:
    rank = _rank()
    if meta.get(WEIGHTS_ONLY_KEY):
        return _load_weights_only(engine, ckpt_dir, meta, saved, layout, options)
    result = LoadResult(loaded=True, path=ckpt_dir)
    source = ckpt_dir
    universal = needs_universal(saved, layout)
    problem = unsaved_optimizer_problem(meta, universal, options.weights_only, options.load_optim)
    if problem is not None:  # before launch: resume_checks.optimizer_state_problems
        raise CheckpointError(f"cannot load {ckpt_dir}: {problem}")
    if universal and options.weights_only and options.new_parameters \
            and meta.get("args", {}).get("train_impl") != args.get("train_impl"):
        raise CheckpointError(
            f"{ckpt_dir} was saved by a {meta.get('args', {}).get('train_impl')!r} run at {saved}; starting a "
            f"{args.get('train_impl')!r} model (new parameters {', '.join(options.new_parameters)}) from it needs "
            f"the same layout ({layout} here): run at the checkpoint's tp/pp, or save the checkpoint at this one"
        )
    if universal:
        check_convertible(saved, layout, moe=int(args.get("moe_num_experts") or 1) > 1)
        if layout.zero_stage == 0 and reshard.plain_torch_optimizer(engine) is None:
            raise CheckpointError(
                f"cannot load {ckpt_dir} (saved at {saved}) into a run at {current_layout(engine)}: without ZeRO only "
                "fp32 runs can change layout (DeepSpeed's fp16/bf16 optimizers keep their own layout there). Use "
                "zero_optimization.stage 1 for this run, or load at the saved layout."
            )
        source = conversion_dir(ckpt_dir, options.save_dir)
        result.notes.append(f"layout changed from {saved} to {layout}: loading through a universal checkpoint "
                            f"({source})")
        error: BaseException | None = None
        if rank == 0:
            try:
                rows = args.get("padded_vocab_size")
                prepare_universal(ckpt_dir, meta, int(rows) if rows else None, source)
            except Exception as err:  # noqa: BLE001 - reported on every rank below
                error = err
        failed = failed_ranks(error is not None)  # also the barrier: rank 0 has converted
        if failed:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"converting {ckpt_dir} for the new layout failed: {error or 'see rank 0'}")
        unseen = failed_ranks(not commit.is_committed(source))
        if unseen:
            raise CheckpointError(
                f"the universal checkpoint {source} that rank 0 wrote is not visible on rank(s) {unseen}: set save "
                "to a directory every node shares (the conversion is written beside it)")

    if universal and reshard.plain_torch_optimizer(engine) is not None:
        restore = options.load_optim and not options.weights_only
        with weights_only_loading(source):
            reshard.load_into_torch_optimizer(engine, source, load_optimizer=restore, load_scheduler=restore)
    elif universal and base_for_adapters(meta.get("args", {}), args, options.weights_only):
        # the adapters are detached (new_parameters.py) and the optimizer holds only them, which a base checkpoint does
        # not have: DeepSpeed's universal loader, which fills the optimizer's parameters, has nothing to read.
        # Every weight left in the module is the frozen base.
        with weights_only_loading(source):
            reshard.load_frozen_parameters(engine, source)
    else:
        with _own_weight_decay(engine, keep=universal):
            result.notes += _engine_load(engine, source, universal, options)
        if universal:
            untie_optimizer_steps(engine)
            with weights_only_loading(source):
                reshard.load_frozen_parameters(engine, source)
    if universal and options.save_dir is None:
        failed_ranks(False)  # every rank has read it
        if rank == 0:
            shutil.rmtree(source, ignore_errors=True)  # a temporary conversion (no `save` to keep it beside)
    load_expert_shards(engine, ckpt_dir, load_optim=options.load_optim and not options.weights_only)
    if options.weights_only:
        result.notes.append(
            "loaded model weights only; optimizer, LR schedule, data position and step start fresh"
            + (" (optimizer moments read for the new layout were reset)" if universal else "")
        )
        if universal:
            _reset_optimizer_state(engine)
        return result

    result.iteration = int(meta["iteration"])
    result.consumed_samples = int(meta["consumed_samples"])
    result.extra = dict(meta.get("extra") or {})
    if not options.load_optim:
        result.notes.append("optimizer state not loaded (no_load_optim)")
        if universal:
            _reset_optimizer_state(engine)
    if options.load_rng:
        rng_file = ckpt_dir / RNG_DIR / f"rank_{rank:05d}.pt"
        same_ranks = (saved.tp, saved.pp, saved.dp) == (layout.tp, layout.pp, layout.dp)
        if same_ranks and rng_file.is_file():
            # the same rank holds the same part of the work (only ZeRO stage or pipeline wrapping changed)
            restore_rng_state(load_trusted_tensors(rng_file))
            result.rng_restored = True
        elif not same_ranks:
            result.notes.append(
                "RNG streams not restored: each rank's streams follow its share of the work, which the new tp/pp/dp "
                "split changes; they are seeded afresh from (seed, iteration)"
            )
        else:
            result.notes.append(f"RNG state missing for rank {rank}; continuing with the seeded streams")
    else:
        result.notes.append("RNG state not loaded (no_load_rng)")
    return result


@contextlib.contextmanager
def _own_weight_decay(engine: Any, keep: bool) -> Iterator[None]:
    """Keep this run's per-group weight decay through a universal load: DeepSpeed's ZeRO-3 loader
    copies the first saved group's hyperparameters onto every group, which would decay biases and
    norms (the no-decay group) in a run with weight decay."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    groups = list(getattr(inner, "param_groups", []) or [])
    decay = [group.get("weight_decay") for group in groups]
    yield
    if keep:
        for group, value in zip(groups, decay):
            if value is not None:
                group["weight_decay"] = value


def _load_weights_only(
    engine: Any, ckpt_dir: Path, meta: dict[str, Any], saved: Layout, layout: Layout, options: LoadOptions
) -> LoadResult:
    """A checkpoint written by a converter: module weights only, at the tp/pp it was written for.

    Any data parallelism and ZeRO stage can read it (DeepSpeed rebuilds its fp32 copies from the module; ZeRO-3,
    whose loader reads its own per-rank files, gets the module filled by ``partitioned_load``); resuming keeps the
    stored iteration but the optimizer starts fresh.
    """
    problems = []
    if (saved.tp, saved.pp, saved.pipeline) != (layout.tp, layout.pp, layout.pipeline):
        want_pp = saved.pp if saved.pipeline else 0
        problems.append(
            f"it holds weights only, written for model_parallel_size {saved.tp} and pipe_parallel_size {want_pp}; "
            f"this run is at {layout}. Run with those sizes, or convert the source again with --tp/--pp for this run"
            + (f" ({meta['converted_from']})" if meta.get("converted_from") else "")
        )
    if problems:
        raise CheckpointError(f"cannot load {ckpt_dir}: " + "; ".join(problems))
    result = LoadResult(loaded=True, path=ckpt_dir)
    if layout.zero_stage == 3:
        try:
            tp = mpu.get_tensor_model_parallel_world_size()
            weights = canonical_rank_weights(ckpt_dir, NeoxNames.from_stored(meta.get("args", {})), tp,
                                             mpu.get_tensor_model_parallel_rank(), pipeline=False)
            result.notes += load_whole_files(engine, weights, options.new_parameters)
        except RuntimeError as err:
            raise CheckpointError(_explain_load_error(ckpt_dir, err)) from err
    else:
        result.notes += _engine_load(engine, ckpt_dir, False, LoadOptions(weights_only=True,
                                                                           new_parameters=options.new_parameters))
    result.notes.append("weights-only checkpoint (converted): optimizer and LR-scheduler state start fresh")
    if not options.weights_only:
        result.iteration = int(meta["iteration"])
        result.consumed_samples = int(meta["consumed_samples"])
    return result


def _engine_load(engine: Any, source: Path, universal: bool, options: LoadOptions) -> list[str]:
    """Load ``source`` into ``engine``; returns notes on parameters left new (``new_parameters``)."""
    new = options.new_parameters if options.weights_only else ()
    try:
        with universal_loading(engine, universal), weights_only_loading(source), \
                tolerating_new_parameters(engine, new) as report:
            path, _ = engine.load_checkpoint(
                str(source.parent),
                source.name,
                load_module_strict=True,
                # weights only from a universal checkpoint: DeepSpeed reads them from its zero/ folder; with
                # "no optimizer states" its ZeRO-3 engine would instead rebuild them with zero_to_fp32 from
                # files a universal checkpoint does not have ('NoneType' object has no attribute 'items')
                load_optimizer_states=(options.load_optim and not options.weights_only)
                or (universal and options.weights_only),
                load_lr_scheduler_states=options.load_optim and not options.weights_only,
                load_module_only=options.weights_only,
            )
    except CheckpointError:
        raise
    except (RuntimeError, AssertionError, KeyError, ValueError) as err:
        raise CheckpointError(_explain_load_error(source, err)) from err
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model files in {source}")
    return report.notes()


def _explain_load_error(source: Path, err: BaseException) -> str:
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = [line for line in lines if line.startswith(("size mismatch", "Missing key", "Unexpected key"))]
    if detail or "Error(s) in loading state_dict" in text:
        return f"checkpoint {source} does not fit this model:\n  " + "\n  ".join(detail or lines[:20])
    return f"loading checkpoint {source} failed: {type(err).__name__}: {text[:2000]}"


def _reset_optimizer_state(engine: Any) -> None:
    """Forget Adam moments and step counts (universal loads always bring them along)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        for key, value in list(state.items()):
            if torch.is_tensor(value):
                value.zero_()
            elif key == "step":
                state[key] = 0


# --- Random-number-generator state ---------------------------------------------------------------
RngState = dict[str, Any]


def _tp_rng_tracker() -> Any:
    """The tensor-parallel RNG tracker (dropout inside tensor-parallel regions draws from it)."""
    return get_rng_tracker()


def capture_rng_state() -> RngState:
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: RngState = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tp_tracker"] = dict(_tp_rng_tracker().get_states())
    return state


def restore_rng_state(state: RngState) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tp_tracker" in state:  # absent in checkpoints of runs that never seeded the tracker
        _tp_rng_tracker().set_states(state["tp_tracker"])
