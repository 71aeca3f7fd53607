"""An exponential moving average (EMA) of the weights, kept beside them: Levanter's ``model_averaging``.

Levanter's rule (``src/levanter/optim/model_averaging.py`` at stanford-crfm/levanter 9263f81e,
``EmaModelAveraging``): the average starts as the initial weights and, after every optimizer step,
becomes ``optax.incremental_update(new, ema, 1 - beta)`` = ``beta * ema + (1 - beta) * weights`` - no
bias correction, no warmup, and every step counts (``TrainerState.take_step`` updates it whether or not
the step's update was applied, ``trainer_state.py``). Levanter averages only the trainable parameters
(``trainables_only``), evaluates both the current weights (``eval/loss``) and the average
(``eval/ema/loss``, ``eval.py`` ``cb_tagged_lm_evaluate``), runs lm-eval and the HF export on the
average (``eval_model``: ``eval_harness.py``, ``compat/hf_checkpoints.py``) and saves it in every
checkpoint (``TrainerState.saveable_state``).

Here each rank averages the parameters of its own module - its tensor-parallel shard, its pipeline
stage; with ZeRO 1/2 every data-parallel rank holds the whole module, so every rank averages the same
copy - in fp32, whatever the training dtype. ZeRO-3 partitions the module itself and is refused
(``averaging_config.averaging_layouts``). The average is written into every checkpoint as
``deepy_ema/tp<t>_pp<p>.pt`` (data-parallel rank 0 of each place) and read back on resume; a resume at
another tp/pp split (or between the pipeline and the plain module, whose parameter names differ) is
refused by name, a change of data-parallel size or ZeRO stage 0-2 reads it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.safe_load import load_trusted_tensors
from megatron.errors import CheckpointError

EMA_DIR = "deepy_ema"


class ModelAverage:
    """The EMA of one rank's trainable parameters, in fp32, updated after every optimizer step."""

    def __init__(self, module: torch.nn.Module, beta: float, *, layout: dict[str, Any] | None = None,
                 place: str = "tp00_pp00", writer: bool = True) -> None:
        """``layout``: what must match for a saved average to be read back (tp, pp, pipeline); ``place``:
        this rank's file name in a checkpoint; ``writer``: this rank writes it (data-parallel rank 0)."""
        self.beta = float(beta)
        self.layout = dict(layout or {})
        self.place = place
        self.writer = writer
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.average = {name: p.detach().float().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """``ema <- beta * ema + (1 - beta) * weights`` (optax's ``incremental_update`` with step size 1 - beta)."""
        for name, param in self.params.items():
            self.average[name].lerp_(param.detach().float(), 1.0 - self.beta)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again at the current weights (a run that loaded weights without an average)."""
        for name, param in self.params.items():
            self.average[name].copy_(param.detach().float())

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module holds the average (in its own dtype) inside the block, its weights again after."""
        saved = {name: p.detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(self.average[name])
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(saved[name])

    # --- checkpoints ------------------------------------------------------------------------------
    def file(self, ckpt_dir: Path) -> Path:
        return ckpt_dir / EMA_DIR / f"{self.place}.pt"

    def save(self, ckpt_dir: Path) -> None:
        """Write this place's average (data-parallel rank 0 only: the other replicas hold the same)."""
        if not self.writer:
            return
        path = self.file(ckpt_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"beta": self.beta, "layout": self.layout,
                    "average": {name: t.detach().cpu().clone() for name, t in self.average.items()}}, path)

    def load(self, ckpt_dir: Path) -> bool:
        """Read this place's average from ``ckpt_dir``; False when the checkpoint has none (saved without
        ``ema_beta``). A checkpoint of another tp/pp split is refused."""
        if not (ckpt_dir / EMA_DIR).is_dir():
            return False
        path = self.file(ckpt_dir)
        saved = load_trusted_tensors(path) if path.is_file() else None
        if saved is None or saved.get("layout") != self.layout:
            raise CheckpointError(
                f"{ckpt_dir} holds the EMA weights (ema_beta) of layout {saved.get('layout') if saved else 'another'}, "
                f"this run is {self.layout}: the average is kept per tensor-parallel shard and pipeline stage and is "
                "not re-split; resume at the saved tp/pp, or set ema_beta: null to drop the average")
        average = saved["average"]
        if set(average) != set(self.average):
            raise CheckpointError(f"{path}: its EMA parameters differ from this model's "
                                  f"({sorted(set(average) ^ set(self.average))[:4]}...)")
        for name, tensor in average.items():
            self.average[name].copy_(tensor)
        return True
