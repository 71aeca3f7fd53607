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
copy - in fp32, whatever the training dtype. Under ZeRO-3 a rank holds only its partition of each
parameter (DeepSpeed's ``param.ds_tensor``: a flat slice of the padded tensor, kept current by the
optimizer step), and the average is kept as the same slice: the update is the same element-wise rule,
so the partitions of the average are the partitions of the stage 0-2 average. Evaluation copies the
average into the partitions (DeepSpeed gathers them for the forward as usual; the parameters it keeps
whole between steps, those under ``stage3_param_persistence_threshold``, are gathered again from them)
and copies the weights back after. The average is written into every checkpoint as
``deepy_ema/tp<t>_pp<p>.pt`` (data-parallel rank 0 of each place) as whole tensors - under ZeRO-3
gathered one parameter at a time - and read back on resume, each ZeRO-3 rank taking its slice; so the
file does not depend on the ZeRO stage or the data-parallel size. A resume at another tp/pp split (or
between the pipeline and the plain module, whose parameter names differ) is refused by name.
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


def _live(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``param``: ZeRO-3's partition (flat, padded) or the whole tensor."""
    partition: torch.Tensor | None = getattr(param, "ds_tensor", None)
    return param if partition is None else partition


def _partition_of(param: torch.nn.Parameter, whole: torch.Tensor, size: int) -> torch.Tensor:
    """This rank's ZeRO-3 slice (``size`` elements, zero padding past the end) of the whole tensor ``whole``."""
    import torch.distributed as dist

    start = dist.get_rank(group=param.ds_process_group) * size  # type: ignore[attr-defined]
    flat = whole.reshape(-1)[start:start + size]
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _regather_held(params: list[torch.nn.Parameter]) -> None:
    """ZeRO-3 parameters held whole between steps (persistent ones) rebuilt from their partitions (every rank)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held = [p for p in params if hasattr(p, "ds_tensor") and p.ds_status == ZeroParamStatus.AVAILABLE]  # type: ignore[attr-defined]
    if held:
        held[0].partition(param_list=held)  # type: ignore[attr-defined]
        held[0].all_gather(param_list=held)  # type: ignore[attr-defined]


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
        self.partitioned = any(hasattr(p, "ds_tensor") for p in self.params.values())
        """ZeRO-3: ``average`` holds this rank's partitions; :meth:`whole` gathers them."""
        self.average = {name: _live(p).detach().float().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """``ema <- beta * ema + (1 - beta) * weights`` (optax's ``incremental_update`` with step size 1 - beta)."""
        for name, param in self.params.items():
            self.average[name].lerp_(_live(param).detach().float(), 1.0 - self.beta)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again at the current weights (a run that loaded weights without an average)."""
        for name, param in self.params.items():
            self.average[name].copy_(_live(param).detach().float())

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module holds the average (in its own dtype) inside the block, its weights again after (every rank
        enters it under ZeRO-3)."""
        saved = {name: _live(p).detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    _live(param).copy_(self.average[name])
                _regather_held(list(self.params.values()))
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    _live(param).copy_(saved[name])
                _regather_held(list(self.params.values()))

    @torch.no_grad()
    def whole(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The average as whole tensors: under ZeRO-3 gathered one parameter at a time (every rank calls it;
        ``keep``: this rank keeps them, the others return an empty dict)."""
        if not self.partitioned:
            return dict(self.average) if keep else {}
        import torch.distributed as dist

        out: dict[str, torch.Tensor] = {}
        for name, param in self.params.items():
            mine = self.average[name]
            if not hasattr(param, "ds_tensor"):
                tensor = mine
            else:
                group = param.ds_process_group  # type: ignore[attr-defined]
                parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group=group))]
                dist.all_gather(parts, mine, group=group)
                tensor = torch.cat(parts)[:param.ds_numel].view(param.ds_shape)  # type: ignore[attr-defined]
            if keep:
                out[name] = tensor
        return out

    # --- checkpoints ------------------------------------------------------------------------------
    def file(self, ckpt_dir: Path) -> Path:
        return ckpt_dir / EMA_DIR / f"{self.place}.pt"

    def save(self, ckpt_dir: Path) -> None:
        """Write this place's average, whole tensors (data-parallel rank 0 only: the other replicas hold the same;
        under ZeRO-3 every rank takes part in the gather)."""
        average = self.whole(keep=self.writer)
        if not self.writer:
            return
        path = self.file(ckpt_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"beta": self.beta, "layout": self.layout,
                    "average": {name: t.detach().cpu().clone() for name, t in average.items()}}, path)

    def load(self, ckpt_dir: Path) -> bool:
        """Read this place's average from ``ckpt_dir``; False when the checkpoint has none (saved without
        ``ema_beta``). A checkpoint of another tp/pp split is refused; any ZeRO stage and data-parallel size
        reads it (a ZeRO-3 rank takes its partition of each tensor)."""
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
            param = self.params[name]
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{path}: the EMA of {name} is {tuple(tensor.shape)}, this model's is {shape}")
            mine = self.average[name]
            mine.copy_(_partition_of(param, tensor, mine.numel()) if hasattr(param, "ds_tensor") else tensor)
        return True
