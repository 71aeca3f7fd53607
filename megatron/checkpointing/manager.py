"""The training loop's one handle on checkpoints: load before the loop, ``maybe_save`` after each step.

::

    ckpt = CheckpointManager.from_config(run.checkpoint, args_record=run.args_record, train_iters=train_iters)
    start = ckpt.load(engine)                      # LoadResult: iteration, consumed_samples
    for step in range(start.iteration + 1, train_iters + 1):
        ...train one step...
        if ckpt.maybe_save(engine, step, consumed_samples).stop:
            break                                  # preempted: checkpoint written, exit 0

Every rank runs the retention policy's step rules itself (they read only the step); for a clock-based
save (``save_interval``) rank 0's clock decides, and its word travels in the preemption flag's
once-per-step all-reduce (``preemption.py``), so every rank saves (or not) after the same step,
whatever its own clock says. Under NCCL that agreement is read one step late (no host wait for the
step in flight): a time-based save then comes one step after rank 0's clock found the interval
elapsed.

The training loop's hooks:
The training loop's checkpoint hooks, wired explicitly by ``pretrain``.

``CheckpointHooks(manager)`` offers ``load(eng, state)`` before the loop, ``after_step(eng, state)``
after every optimizer step (returns True to stop: preemption) and ``at_exit(eng, state)`` once at
the end. ``validate`` (``checkpoint_validation_with_forward_pass``) is a function computing the loss
of a fixed batch: after every save the weights just written are read back into the engine and that
loss must not change.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron import object_store
from megatron.checkpointing import commit, discovery
from megatron.checkpointing.remote import Mirror, staging_dir
from megatron.checkpointing.neox import GqaOrder, load_neox_weights, neox_position
from megatron.checkpointing.preemption import PreemptionWatcher
from megatron.checkpointing.commit import (
    CheckpointKind,
    CommittedCheckpoint,
    KeepRule,
    RetentionPolicy,
    SaveDecision,
)
from megatron.checkpointing.config import CheckpointArgs
from megatron.checkpointing.universal import foreign_conversions, universal_checkpoint_info
from megatron.checkpointing.save_load import (
    BeforeCommit,
    LoadOptions,
    LoadResult,
    PendingSave,
    SaveRequest,
    commit_checkpoint,
    current_layout,
    failed_ranks,
    load_checkpoint,
    resolve_tag,
    write_checkpoint,
)
from megatron.errors import CheckpointError, ConfigError
from megatron.time_phrases import parse_duration

log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks


@dataclass(frozen=True)
class SaveOutcome:
    saved: bool
    stop: bool
    """True when the run was preempted: the loop should end (the checkpoint is written)."""


def parse_save_interval(value: str | int | float | None) -> float | None:
    """``save_interval`` in seconds: a number of seconds or a phrase such as ``15min``."""
    if value is None:
        return None
    try:
        return float(parse_duration(value))
    except ValueError as err:
        raise ConfigError(f"save_interval: {err}") from err


def keep_rules(raw: list[dict[str, int | None]] | None) -> list[KeepRule]:
    rules = []
    for item in raw or []:
        unknown = set(item) - {"every", "until"}
        every = item.get("every")
        if every is None or unknown:
            raise ConfigError(f"keep: each rule is {{every: N, until: M}} (until optional); got {item!r}")
        rules.append(KeepRule(every=int(every), until=item.get("until")))
    return rules


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _local_rank() -> int:
    """This rank's place on its node (the launchers' LOCAL_RANK): the first rank of a node moves its files."""
    return int(os.environ.get("LOCAL_RANK", "0"))


class InFlight:
    """A save whose files are being written in the background; its commit runs on this thread too, with
    agreements on ``group`` (every rank's, gloo), so the training thread never waits for the slowest disk."""

    def __init__(self, pending: PendingSave, group: Any, complete: Callable[[PendingSave, Any], None]) -> None:
        self.pending = pending
        self.error: BaseException | None = None

        def run() -> None:
            try:
                complete(pending, group)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread by wait()
                self.error = err
                log.error("background save of %s failed: %s (the run stops at its next save)", pending.final_dir, err)

        self._thread = threading.Thread(target=run, name=f"deepy-commit-{pending.request.step}", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()


def _same_dir(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


class CheckpointManager:
    """Owns the save directory, the retention policy and the preemption flag of one run."""

    def __init__(
        self,
        *,
        save: str | None,
        load: str | None,
        policy: RetentionPolicy,
        args_dict: dict[str, Any],
        config_files: dict[str, str] | None = None,
        finetune: bool = False,
        initialize_from: str | None = None,
        iteration: int | None = None,
        no_load_optim: bool = False,
        no_load_rng: bool = False,
        save_rng: bool = True,
        save_optim: bool = True,
        preemption: PreemptionWatcher | None = None,
        before_commit: BeforeCommit | None = None,
        load_requested: bool = False,
        new_parameters: tuple[str, ...] = (),
        neox_qkv_order: GqaOrder | None = None,
        async_save: bool = False,
        mirror: Mirror | None = None,
        load_mirror: Mirror | None = None,
    ) -> None:
        self.neox_qkv_order = neox_qkv_order
        self.async_save = async_save
        """Write in the background (``background_writes.py``); commit on a thread of its own, one save at a time."""
        self.mirror = mirror
        """The object-store prefix that follows ``save`` (``s3_path``, or ``save`` itself in a bucket)."""
        self.load_mirror = load_mirror
        """``load`` in a bucket: its committed checkpoints are brought into ``load_dir`` (staging) before loading."""
        self.in_flight: InFlight | None = None
        self._save_group: Any = None
        """How a grouped-query GPT-NeoX checkpoint's QKV rows are ordered (``neox/load.py``)."""
        self.save_dir = Path(save) if save else None
        self.load_dir = Path(load) if load else None
        self.load_requested = load_requested
        self.new_parameters = new_parameters
        """The objective's parameters a weights-only start may lack (see ``new_parameters.py``)."""
        self.policy = policy
        self.args_dict = args_dict
        self.config_files = dict(config_files or {})
        self.finetune = finetune
        self.initialize_from = Path(initialize_from) if initialize_from else None
        self.iteration = iteration
        self.no_load_optim = no_load_optim
        self.no_load_rng = no_load_rng
        self.save_rng = save_rng
        self.save_optim = save_optim
        """False (``no_save_optim``): checkpoints hold the module's weights, no optimizer or LR-scheduler state."""
        self.preemption = preemption if preemption is not None else PreemptionWatcher().install()
        self.before_commit = before_commit
        self.last_saved_step: int | None = None
        self.resumed_from: Path | None = None
        """The checkpoint this run resumed (its state is the run's state until the next step)."""
        self.universal_info: dict[str, Any] | None = None
        """DeepSpeed's TP merge patterns for this model; set by whoever knows the model."""
        self.rank_files: list[Callable[[Path], None]] = []
        """Writers of other components' files into each checkpoint (``SaveRequest.rank_files``)."""

    @classmethod
    def from_config(
        cls,
        config: CheckpointArgs,
        *,
        args_record: dict[str, Any],
        train_iters: int,
        clock: Callable[[], float] = time.monotonic,
        before_commit: BeforeCommit | None = None,
        new_parameters: tuple[str, ...] = (),
        preemption: PreemptionWatcher | None = None,
    ) -> CheckpointManager:
        """``train_iters``: the run's last step (given, or derived at start-up from train_epochs), which
        retention always keeps. ``preemption``: None installs the signal handlers of a new watcher."""
        factor = config.checkpoint_factor
        policy = RetentionPolicy(
            train_iters=int(train_iters),
            checkpoint_factor=int(factor) if factor else None,
            checkpoint_scale=config.checkpoint_scale,
            extra_save_iters=config.extra_save_iters,
            keep_last_n_checkpoints=config.keep_last_n_checkpoints,
            save_interval_s=parse_save_interval(config.save_interval),
            keep=keep_rules(config.keep),
            clock=clock,
        )
        chunk, s3_path, staging = int(config.s3_chunk_size), config.s3_path, config.checkpoint_staging_dir
        save, mirror = config.save, None
        if save and object_store.is_remote(save):
            mirror = Mirror(save, chunk, is_save=True)
            save = str(staging_dir(save, staging))
        elif save and s3_path:
            mirror = Mirror.for_s3_path(s3_path, save, chunk)
        load = config.load if config.load_checkpoint else None
        load_mirror = None
        if load and object_store.is_remote(load):
            load_mirror = mirror if mirror is not None and mirror.url == load else Mirror(load, chunk, is_save=True)
            load = str(staging_dir(load, staging))
        return cls(
            save=save,
            load=load,
            async_save=config.async_save,
            mirror=mirror,
            load_mirror=load_mirror,
            policy=policy,
            args_dict=args_record,
            config_files=config.config_files,
            finetune=config.finetune,
            initialize_from=config.initialize_from,
            iteration=config.iteration,
            no_load_optim=config.no_load_optim,
            no_load_rng=config.no_load_rng,
            save_rng=not config.no_save_rng,
            save_optim=not config.no_save_optim,
            before_commit=before_commit,
            load_requested=bool(config.load),
            new_parameters=new_parameters,
            preemption=preemption,
            neox_qkv_order=config.neox_qkv_order,
        )

    # --- load ----------------------------------------------------------------------------------
    def load(self, engine: Any) -> LoadResult:
        """Resume from ``load`` if it holds a committed checkpoint, else initialize/fine-tune, else fresh.

        Loading is explicit: ``load`` holding anything but committed Deepy checkpoints is an error
        naming what is there (see ``discovery``), except a missing/empty ``load`` that is also ``save``.
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._bring_from_object_store()
        neox = self._gpt_neox_source()
        if neox is not None:
            return self._load_gpt_neox(engine, neox, rank)
        resume_tag: str | None = None
        if self.load_dir is not None:
            resume_tag = self._committed_tag(engine, rank)

        if self.finetune or (self.initialize_from is not None and resume_tag is None):
            return self._initialize(engine, rank)

        if resume_tag is None or self.load_dir is None:
            self._check_fresh_start()
            if rank == 0 and self.load_dir is not None:
                log.info("%s is empty: this is the first run, starting from scratch", self.load_dir)
            elif rank == 0 and self.load_requested:
                log.info("load_checkpoint: false: not loading from `load`, starting from scratch")
            return LoadResult(loaded=False)
        restart = self._own_checkpoint(self.load_dir, f"resumes from load: {self.load_dir}")
        if restart is not None:
            if rank == 0:
                log.info("%s already holds %s of this run: resuming it, not re-loading %s", self.save_dir, restart,
                         self.load_dir)
            assert self.save_dir is not None
            return self._resume(engine, self.save_dir, restart, rank)
        return self._resume(engine, self.load_dir, resume_tag, rank)

    def _bring_from_object_store(self) -> None:
        """``load`` (and a bucket ``save``, where a restart finds its own checkpoints) made to list what the bucket
        holds committed, and the checkpoint to be loaded downloaded whole; by each node's first rank, the others
        waiting. A checkpoint whose upload never finished is not in the listing: the one before it is loaded."""
        pairs = [(m, d) for m, d in ((self.load_mirror, self.load_dir), (self.mirror, self.save_dir))
                 if m is not None and m.is_save and d is not None]
        if not pairs:
            return
        error: BaseException | None = None
        if _local_rank() == 0:
            try:
                seen = set()
                for mirror, directory in pairs:
                    if mirror.url in seen:
                        continue
                    seen.add(mirror.url)
                    if mirror.sync_listing(directory):
                        wanted = self.iteration if mirror is self.load_mirror and not self.finetune else None
                        tag, _ = resolve_tag(directory, wanted)
                        if tag is not None:
                            mirror.fetch(directory, tag)
            except Exception as err:  # noqa: BLE001 - every rank raises together below
                error = err
        failed = failed_ranks(error is not None)
        if failed:
            reason = f"{type(error).__name__}: {error}" if error else f"see the log of rank {failed[0]}"
            raise CheckpointError(f"reading the checkpoints in {pairs[0][0].url} failed ({reason})")

    def _own_checkpoint(self, source: Path, this_run: str) -> str | None:
        """The newest committed checkpoint in ``save`` when ``save`` is not ``source`` (where this run starts from)
        and the checkpoint is this run's (a restart: resume it); None when ``save`` holds none. Another run's there
        is an error: this run's saves would be mixed with it."""
        if self.save_dir is None or _same_dir(self.save_dir, source):
            return None
        found = discovery.run_in_save(self.save_dir, load=str(self.load_dir) if self.load_dir else None,
                                      initialize_from=str(self.initialize_from) if self.initialize_from else None,
                                      finetune=self.finetune)
        if found is None:
            return None
        tag, recorded = found
        if not discovery.same_source(recorded, load=str(self.load_dir) if self.load_dir else None,
                                     initialize_from=str(self.initialize_from) if self.initialize_from else None,
                                     finetune=self.finetune):
            raise CheckpointError(discovery.foreign_run_message(self.save_dir, tag, recorded, this_run))
        return tag

    def _gpt_neox_source(self) -> Path | None:
        """The GPT-NeoX checkpoint (tag directory) to start from, if ``initialize_from`` or ``load`` is one."""
        source = self.initialize_from or self.load_dir
        if source is None:
            return None
        if self.initialize_from is not None and self.load_dir is not None and not self.finetune:
            if discovery.inspect_load_dir(self.load_dir).kind == "deepy":
                return None  # this run's own checkpoints: a resume
        found = discovery.inspect_load_dir(source)
        return found.foreign_tag if found.kind == "gpt_neox" else None

    def _load_gpt_neox(self, engine: Any, tag: Path, rank: int) -> LoadResult:
        """Weights of a GPT-NeoX checkpoint; a resume (``load`` without ``finetune``) keeps its position.
        A restarted run that already saved its own checkpoints continues from those instead."""
        if self.save_dir is not None and not _same_dir(self.save_dir, tag.parent):
            own_tag = self._own_checkpoint(tag.parent, f"starts from the GPT-NeoX checkpoint {tag}")
            if own_tag is not None:
                if rank == 0:
                    log.info("%s already holds %s of this run: resuming it, not re-loading %s", self.save_dir,
                             own_tag, tag)
                return self._resume(engine, self.save_dir, own_tag, rank)
        result = LoadResult(loaded=True, path=tag, notes=load_neox_weights(engine, tag, self.args_dict,
                                                                                      self.neox_qkv_order))
        weights_only = self.finetune or self.initialize_from is not None
        if not weights_only:
            result.iteration, result.consumed_samples = neox_position(tag, self.args_dict)
            self.last_saved_step = result.iteration
        self._report(rank, result, "initialized weights from" if weights_only else "resumed from")
        return result

    def _committed_tag(self, engine: Any, rank: int) -> str | None:
        """The tag to load from ``load``; None only for the first run of a ``save == load`` setup."""
        assert self.load_dir is not None
        found = discovery.inspect_load_dir(self.load_dir)
        if found.kind == "deepy":
            tag, warnings = resolve_tag(self.load_dir, None if self.finetune else self.iteration)
            if rank == 0:
                for warning in warnings:
                    log.warning(warning)
            return tag
        first_run = found.kind in ("missing", "empty") and self.save_dir is not None and _same_dir(
            self.save_dir, self.load_dir
        )
        if first_run or (found.kind in ("missing", "empty") and self.finetune):
            return None  # fine-tuning reports its own missing source
        layout = current_layout(engine)
        raise CheckpointError(discovery.explain(found, layout.tp, layout.pp if layout.pipeline else 0))

    def _check_fresh_start(self) -> None:
        """A fresh run must not write into a save directory that holds another run's checkpoints:
        its saves would be skipped as "already on disk" and mixed with them."""
        if self.save_dir is None:
            return
        foreign = discovery.inspect_load_dir(self.save_dir)
        if foreign.kind in ("gpt_neox", "hf_model"):
            what = "a GPT-NeoX checkpoint" if foreign.kind == "gpt_neox" else "a Hugging Face model"
            raise CheckpointError(f"save: {self.save_dir} holds {what}; writing Deepy checkpoints there would replace "
                                  "its files (and its `latest`). Save to another directory.")
        if self.load_dir is not None and _same_dir(self.save_dir, self.load_dir):
            return
        steps = commit.list_checkpoints(self.save_dir).steps
        if steps:
            why = "load_checkpoint: false" if self.load_dir is None and self.load_requested else "no load"
            raise CheckpointError(
                f"save: {self.save_dir} already holds committed checkpoints ({', '.join(map(str, steps[-5:]))}) and "
                f"this run starts fresh ({why}): its checkpoints would collide with them. Save to a new "
                f"directory, remove the old checkpoints, or set load: {self.save_dir} to resume them."
            )

    def _initialize(self, engine: Any, rank: int) -> LoadResult:
        """Weights only (finetune / initialize_from), unless this run already saved its own."""
        source_dir = self.initialize_from or self.load_dir
        if source_dir is None:
            raise ConfigError("finetune: true needs `load` (or `initialize_from`) to name a checkpoint directory")
        # A restarted fine-tune (preempted, crashed) must continue from its own checkpoints in
        # `save`, not start over from the weights it was initialized with.
        if self.save_dir is not None and self.save_dir.resolve() != source_dir.resolve():
            own_tag = self._own_checkpoint(source_dir, f"starts from the weights of {source_dir}")
            if own_tag is not None:
                if rank == 0:
                    log.info("%s already holds %s of this run: resuming it, not re-initializing", self.save_dir, own_tag)
                return self._resume(engine, self.save_dir, own_tag, rank)
        tag, _ = resolve_tag(source_dir, self.iteration if self.finetune else None)
        if tag is None:
            layout = current_layout(engine)
            key = "initialize_from" if self.initialize_from is not None else "load"
            found = discovery.inspect_load_dir(source_dir)
            raise CheckpointError(discovery.explain(found, layout.tp, layout.pp if layout.pipeline else 0, key))
        result = load_checkpoint(engine, source_dir / tag, self.args_dict,
                                 LoadOptions(weights_only=True, new_parameters=self.new_parameters,
                                             save_dir=self.save_dir))
        self._report(rank, result, "initialized weights from")
        return result

    def _resume(self, engine: Any, directory: Path, tag: str, rank: int) -> LoadResult:
        options = LoadOptions(load_optim=not self.no_load_optim, load_rng=not self.no_load_rng, save_dir=self.save_dir)
        result = load_checkpoint(engine, directory / tag, self.args_dict, options)
        self._report(rank, result, "resumed from")
        self.last_saved_step = result.iteration
        self.resumed_from = (directory / tag).resolve()
        return result

    @staticmethod
    def _report(rank: int, result: LoadResult, verb: str) -> None:
        if rank != 0:
            return
        log.info("%s %s (iteration %d, consumed samples %d)", verb, result.path, result.iteration, result.consumed_samples)
        for note in result.notes:
            log.info("checkpoint: %s", note)

    # --- save ----------------------------------------------------------------------------------
    def maybe_save(
        self, engine: Any, step: int, consumed_samples: int, extra: dict[str, Any] | None = None
    ) -> SaveOutcome:
        """Call after every optimizer step, on every rank (it holds collectives)."""
        agreed = self.preemption.agree(self._time_save_step(step))
        stop = agreed.stop
        if self.save_dir is None:
            if stop:
                log.warning("preempted (%s) with no `save` directory: nothing is saved", self.preemption.signal_name)
            return SaveOutcome(saved=False, stop=stop)
        # a time-based save posted before the last save (a step late under NCCL) is already served
        decision = self.policy.decide(step, time_due=agreed.time_save_step > (self.last_saved_step or 0))
        if stop and not decision.save:
            decision = SaveDecision(save=True, kind="temporary", reason=f"preempted by {self.preemption.signal_name}")
        if not decision.save:
            return SaveOutcome(saved=False, stop=stop)
        self.save(engine, step, consumed_samples, decision.kind, extra)
        if stop:
            self.wait("the run stops")  # preempted: the checkpoint is committed before the process ends
        return SaveOutcome(saved=True, stop=stop)

    def save(
        self,
        engine: Any,
        step: int,
        consumed_samples: int,
        kind: CheckpointKind = "step",
        extra: dict[str, Any] | None = None,
    ) -> None:
        assert self.save_dir is not None
        request = SaveRequest(
            step=step,
            consumed_samples=consumed_samples,
            kind=kind,
            layout=current_layout(engine),
            args={**self.args_dict, "iteration": step},
            config_files=self.config_files,
            extra=dict(extra or {}),
            save_rng=self.save_rng,
            save_optim=self.save_optim,
            universal_info=self.universal_info,
            before_commit=self.before_commit,
            rank_files=tuple(self.rank_files),
            keep_existing=self.resumed_from == (self.save_dir / commit.tag_for(step)).resolve(),
        )
        if self.in_flight is not None:
            self.wait(f"the save of step {step}")
        pending = write_checkpoint(engine, self.save_dir, request, background=self.async_save)
        self.policy.on_committed()
        self.last_saved_step = step
        if pending is None:
            return
        if not self.async_save:
            self._complete(pending, None)
            return
        if self._save_group is None and dist.is_initialized():
            # the background commit's agreements travel on a gloo group of their own: collectives of two threads
            # on one group could pair with each other's
            self._save_group = dist.new_group(backend="gloo")
        self.in_flight = InFlight(pending, self._save_group, self._complete)
        if _rank() == 0 and pending.writes is not None:
            log.info("checkpoint %s: the state (%.1f MB) is in host memory after %.2fs; writing it in the background",
                     pending.final_dir.name, pending.writes.nbytes / 1e6, time.monotonic() - pending.started)

    def wait(self, why: str) -> None:
        """Until the save in flight is committed (or raise its error, on every rank: each learned it in the same
        agreement); says how long it waited."""
        if self.in_flight is None:
            return
        in_flight, self.in_flight = self.in_flight, None
        started = time.monotonic()
        in_flight.join()
        waited = time.monotonic() - started
        if _rank() == 0 and waited >= 0.01:
            log.info("%s waited %.2fs for the background save of %s", why, waited, in_flight.pending.final_dir.name)
        if in_flight.error is not None:
            if isinstance(in_flight.error, CheckpointError):
                raise in_flight.error
            raise CheckpointError(f"the background save of {in_flight.pending.final_dir} failed: "
                                  f"{type(in_flight.error).__name__}: {in_flight.error}") from in_flight.error

    def _complete(self, pending: PendingSave, group: Any) -> None:
        """Commit (every rank), upload (object storage), then retention."""
        commit_checkpoint(pending, group, after_commit=self._uploads(pending))
        self._apply_retention(pending.request.step)
        self._remove_foreign_conversions()

    def _uploads(self, pending: PendingSave) -> list[Callable[[], None]]:
        mirror = self.mirror
        if mirror is None:
            return []
        tag, save, rank = commit.tag_for(pending.request.step), pending.save, _rank()
        uploads = mirror.uploads_on(rank, _local_rank())
        steps = [lambda: mirror.upload(save, tag) if uploads else None]  # every rank joins each step's agreement
        if mirror.is_save:
            steps.append(lambda: mirror.seal(save, tag) if rank == 0 else None)
        return steps

    def _time_save_step(self, step: int) -> int:
        """What this rank posts for the clock's part of the save decision: ``step`` when it is rank 0
        and its clock finds the interval elapsed, else 0 (only rank 0's clock decides)."""
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        return step if rank0 and self.save_dir is not None and self.policy.interval_elapsed() else 0

    def _apply_retention(self, step: int) -> None:
        if self.save_dir is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        listing = commit.list_checkpoints(self.save_dir)
        # checkpoints after this step belong to the trajectory a rewind (``iteration``) left: they never count
        # against this one's (keep_last_n would otherwise delete the new checkpoints and keep the old ones)
        committed = [CommittedCheckpoint(s, info.kind) for s, info in listing.committed.items() if s <= step]
        for doomed in self.policy.to_delete(committed):
            try:
                commit.remove_checkpoint(self.save_dir, doomed)
                if self.mirror is not None and self.mirror.is_save:
                    self.mirror.delete(commit.tag_for(doomed))
                log.info("retention: deleted checkpoint at step %d", doomed)
            except Exception as err:  # noqa: BLE001 - a file system's or an object store's error
                log.warning("retention: could not delete checkpoint at step %d: %s", doomed, err)

    def _remove_foreign_conversions(self) -> None:
        """Conversions of another directory's checkpoint written into ``save`` (``universal.conversion_dir``) are
        not needed once this run has a committed checkpoint of its own: a restart resumes that one."""
        if self.save_dir is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        for path in foreign_conversions(self.save_dir):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s: this run's own checkpoints replace it", path)


# --- The training loop's hooks -------------------------------------------------------------------
log = logging.getLogger("deepy.checkpoint")  # a child of the run logger: rank 0 speaks


class CheckpointHooks:
    def __init__(self, manager: CheckpointManager, validate: Callable[[], float] | None = None,
                 reseed: Callable[[int], None] | None = None) -> None:
        """``reseed(iteration)``: seeds fresh RNG streams when a resume cannot restore the saved ones
        (the tp/pp/dp split changed), so the run does not replay the dropout masks of its first steps."""
        self.manager = manager
        self.validate = validate
        self.reseed = reseed

    def attach_model(self, eng: Any, tp: int) -> None:
        """Record how the model's tensors split over tp, so later loads can change the layout."""
        self.manager.universal_info = universal_checkpoint_info(eng.config, tp)

    def load(self, eng: Any, state: Any) -> Any:
        """Restore the engine and return the loop's state (the given one when nothing was loaded)."""
        result = self.manager.load(eng.engine)
        if not result.loaded:
            return state
        if result.iteration == 0 and result.consumed_samples == 0:
            return state  # weights only (finetune / initialize_from): progress starts at zero
        if not result.rng_restored and not self.manager.no_load_rng and self.reseed is not None:
            self.reseed(result.iteration)
        saved = dict(result.extra.get("train_state") or {})
        saved.update(iteration=result.iteration, consumed_samples=result.consumed_samples, stop_reason=None)
        return type(state).from_dict({**state.to_dict(), **saved})

    def after_step(self, eng: Any, state: Any) -> bool:
        before = self.manager.last_saved_step
        outcome = self.manager.maybe_save(
            eng.engine, state.iteration, state.consumed_samples, extra={"train_state": state.to_dict()}
        )
        if outcome.saved and self.manager.last_saved_step != before:
            self._check_reload(eng, state.iteration)
        if outcome.stop:
            state.stop_reason = f"preempted ({self.manager.preemption.signal_name}); checkpoint saved"
        return outcome.stop

    def at_exit(self, eng: Any, state: Any) -> None:
        """Save when the loop ended early (exit_interval) and the last step is not on disk yet."""
        manager = self.manager
        if manager.save_dir is None or manager.last_saved_step == state.iteration or state.iteration == 0:
            manager.wait("the end of the run")
            return
        manager.save(eng.engine, state.iteration, state.consumed_samples, "step",
                     extra={"train_state": state.to_dict()})
        self._check_reload(eng, state.iteration)
        manager.wait("the end of the run")

    def _check_reload(self, eng: Any, step: int) -> None:
        if self.validate is None or self.manager.save_dir is None:
            return
        self.manager.wait("checkpoint_validation_with_forward_pass")
        before = self.validate()
        ckpt_dir = self.manager.save_dir / commit.tag_for(step)
        load_checkpoint(eng.engine, ckpt_dir, self.manager.args_dict, LoadOptions(weights_only=True))
        after = self.validate()
        if not (math.isfinite(before) and after == before):
            raise CheckpointError(
                f"checkpoint_validation_with_forward_pass: {ckpt_dir} does not reproduce the model: the "
                f"loss of the validation batch was {before!r} before saving and {after!r} after reading "
                f"the saved weights back"
            )
        log.info("checkpoint %s validated: reloaded weights give the same loss (%.6f)", ckpt_dir.name, after)
