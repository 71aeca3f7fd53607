"""Where a frozen reference model's starting weights come from (``frozen.py``'s module docstring has the rule),
resolved from the configuration and the checkpoints on disk: files only, no torch, so the check before launch
(``objectives/checks.py``) asks the same questions the ranks ask."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpointing import commit
from megatron.checkpointing.config import CheckpointArgs
from megatron.errors import ConfigError


@dataclass(frozen=True)
class StartingPoint:
    checkpoint: Path | None
    """A committed checkpoint directory (``<dir>/global_stepN``), or None for the seeded init."""

    def __str__(self) -> str:
        return str(self.checkpoint) if self.checkpoint is not None else "the seeded initialisation"


def _committed(directory: str, iteration: int | None, key: str) -> Path:
    # lazy: save_load imports DeepSpeed; the launcher's checks read checkpoints without it
    from megatron.checkpointing.save_load import resolve_tag

    tag, _ = resolve_tag(Path(directory), iteration)
    if tag is None:
        raise ConfigError(f"{key}={directory!r}: no committed checkpoint there to take the reference model from")
    return Path(directory) / tag


def starting_point(config: CheckpointArgs, train_impl: str, _depth: int = 0) -> StartingPoint:
    """Where the policy's starting weights, hence the frozen reference, come from (see module doc): the
    checkpoint keys of this run (``config``), of an objective ``train_impl``."""
    # lazy: save_load imports DeepSpeed; the launcher's checks read checkpoints without it
    from megatron.checkpointing.save_load import read_meta

    if config.initialize_from:
        return StartingPoint(_committed(config.initialize_from, None, "initialize_from"))
    if config.finetune and config.load:
        return StartingPoint(_committed(config.load, config.iteration, "load"))
    if config.load and _depth == 0:
        tag, _ = commit.newest_committed(Path(config.load))
        if tag is not None:
            saved = read_meta(Path(config.load) / tag).get("args", {})
            problem = other_objective_problem(config.load, saved, train_impl)
            if problem is not None:
                raise ConfigError(problem)
            where = CheckpointArgs(load=saved.get("load"), finetune=bool(saved.get("finetune")),
                                   initialize_from=saved.get("initialize_from"), iteration=saved.get("iteration"))
            return starting_point(where, train_impl, _depth + 1)
    return StartingPoint(None)


def other_objective_problem(load: str, saved: dict[str, Any], train_impl: str) -> str | None:
    """Resuming (no finetune, no initialize_from) a checkpoint of ``load`` that another objective wrote, whose
    recorded arguments are ``saved``: the reference would be lost at the next resume."""
    if saved.get("train_impl") == train_impl:
        return None
    return (f"load={load!r} holds a train_impl={saved.get('train_impl')!r} checkpoint and this "
            f"run is train_impl={train_impl!r}: its reference model is a frozen copy of the "
            "starting weights, which must stay known when the run resumes. Start from that checkpoint "
            f"with initialize_from: {load} (or finetune: true), and save to another directory")
