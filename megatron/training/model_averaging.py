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

Here each rank averages what it holds of the parameters of its own module - its tensor-parallel shard, its
pipeline stage - in fp32, whatever the training dtype. Under bf16 and fp16 the optimizer keeps fp32 master weights
beside the module's bf16/fp16 copy, and the average follows the masters (Levanter averages its parameters,
``trainer_state.py:156-157``, which its default mixed-precision policy ``trainer.mp = f32``, ``trainer.py:647``,
and Deepy's ``precision: bfloat16`` as ``p=f32,c=bfloat16`` keep in fp32): averaging the module's copy would
average the weights rounded to 8 (bf16) bits of mantissa. Each rank averages the part of the masters its optimizer
holds (``deepspeed_internals.fp32_master_slices``), in place, one fused ``lerp`` per step and no collective:
without ZeRO (DeepSpeed's fp16 optimizers) the whole parameter on every rank; ZeRO-1/2 and DeepSpeed's bf16
optimizer (a pipeline's bf16, ZeRO-1 with fp32 gradient accumulation) the fragment of each parameter inside this
rank's flat fp32 partition - possibly none of it; ZeRO-3 this rank's partition of each parameter (flat, padded),
the elements of ``param.ds_tensor``. In fp32 the module's weights are the ones the optimizer steps (ZeRO-1/2 copy
the fp32 partitions into them exactly), and the average reads them: the whole parameter on every rank, under
ZeRO-3 the partition ``ds_tensor`` (kept current by the optimizer step). The update is the same element-wise rule
wherever the elements are, so the slices of the average are the slices of the whole average. Evaluation copies the
average into the module (in its dtype: ZeRO-1/2 and the bf16 optimizer assemble each parameter from the fragments
first, one all-reduce per parameter; ZeRO-3 copies it into the partitions and DeepSpeed gathers them for the
forward as usual, the parameters it keeps whole between steps, those under ``stage3_param_persistence_threshold``,
gathered again from them) and copies the weights back after. The average is written into every checkpoint as
``deepy_ema/tp<t>_pp<p>.pt`` (data-parallel rank 0 of each place) as whole fp32 tensors - assembled one parameter
at a time where it is in slices - and read back on resume, each rank taking its slice; so the file does not depend
on the ZeRO stage, the precision or the data-parallel size. A resume at another tp/pp split (or between the
pipeline and the plain module, whose parameter names differ) is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from megatron.checkpointing.safe_load import load_trusted_tensors
from megatron.deepspeed_internals import fp32_master_slices
from megatron.errors import CheckpointError
from megatron.torch_internals import lerp_all_

EMA_DIR = "deepy_ema"


def _live(param: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``param``: ZeRO-3's partition (flat, padded) or the whole tensor."""
    partition: torch.Tensor | None = getattr(param, "ds_tensor", None)
    return param if partition is None else partition


def _regather_held(params: list[torch.nn.Parameter]) -> None:
    """ZeRO-3 parameters held whole between steps (persistent ones) rebuilt from their partitions (every rank)."""
    held = [p for p in params if hasattr(p, "ds_tensor") and p.ds_status == ZeroParamStatus.AVAILABLE]  # type: ignore[attr-defined]
    if held:
        held[0].partition(param_list=held)  # type: ignore[attr-defined]
        held[0].all_gather(param_list=held)  # type: ignore[attr-defined]


@dataclass
class _Slice:
    """What this rank averages of one parameter: ``source`` (the fp32 masters, else the module's weights), elements
    ``start .. start + numel`` of the flattened parameter (ZeRO-3: padded to its partition group); ``group``: the
    ranks whose slices make up the whole (None: ``source`` is the whole parameter, in its shape); ``partition``:
    ZeRO-3's equal-sized partitions (gathered), else disjoint fragments of any size (summed)."""

    source: torch.Tensor
    start: int = 0
    group: Any = None
    partition: bool = False


def _slices(params: dict[str, torch.nn.Parameter], optimizer: Any) -> dict[str, _Slice]:
    """Where each parameter's average comes from on this rank: the optimizer's fp32 masters when the module's
    weights are a bf16/fp16 copy of them, else the weights this rank holds."""
    lower = [name for name, p in params.items() if _live(p).dtype != torch.float32]
    masters = {} if optimizer is None or not lower else dict(
        zip(lower, fp32_master_slices(optimizer, [params[n] for n in lower])))
    out = {}
    for name, param in params.items():
        zero3 = hasattr(param, "ds_tensor")
        master = masters.get(name)
        if master is not None:
            view, start, group = master
            out[name] = _Slice(view.view(param.shape) if group is None else view, start, group, zero3)
        elif zero3:
            group = param.ds_process_group  # type: ignore[attr-defined]
            size = _live(param).numel()
            out[name] = _Slice(_live(param), dist.get_rank(group=group) * size, group, True)
        else:
            out[name] = _Slice(param)
    return out


class ModelAverage:
    """The EMA of one rank's trainable parameters, in fp32, updated after every optimizer step."""

    def __init__(self, module: torch.nn.Module, beta: float, *, optimizer: Any = None,
                 layout: dict[str, Any] | None = None, place: str = "tp00_pp00", writer: bool = True) -> None:
        """``optimizer``: the engine's, whose fp32 master weights the average follows under bf16/fp16 (None: the
        module's weights); ``layout``: what must match for a saved average to be read back (tp, pp, pipeline);
        ``place``: this rank's file name in a checkpoint; ``writer``: this rank writes it (data-parallel rank 0)."""
        self.beta = float(beta)
        self.layout = dict(layout or {})
        self.place = place
        self.writer = writer
        self.optimizer = optimizer
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.partitioned = any(hasattr(p, "ds_tensor") for p in self.params.values())
        """ZeRO-3: ``average`` holds this rank's partitions; :meth:`whole` gathers them."""
        self.slices = _slices(self.params, optimizer)
        self.masters = any(s.source.dtype == torch.float32 and _live(p).dtype != torch.float32
                           for p, s in zip(self.params.values(), self.slices.values()))
        """The average follows the optimizer's fp32 master weights (bf16/fp16 training)."""
        self.average = {name: s.source.detach().float().clone() for name, s in self.slices.items()}
        self._pair()

    def _pair(self) -> None:
        """The (average, source) pairs one step's update reads: fp32 sources in one fused call, others cast."""
        pairs = [(self.average[name], held.source) for name, held in self.slices.items()]
        self._fp32 = ([a for a, w in pairs if w.dtype == a.dtype], [w for a, w in pairs if w.dtype == a.dtype])
        self._cast = [(a, w) for a, w in pairs if w.dtype != a.dtype]  # bf16/fp16 weights without an fp32 copy

    @torch.no_grad()
    def update(self) -> None:
        """``ema <- beta * ema + (1 - beta) * weights`` (optax's ``incremental_update`` with step size 1 - beta)."""
        lerp_all_(*self._fp32, 1.0 - self.beta)
        for average, weights in self._cast:
            average.lerp_(weights.float(), 1.0 - self.beta)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average again at the current weights (a run that loaded weights without an average)."""
        self.slices = _slices(self.params, self.optimizer)
        for name, held in self.slices.items():
            self.average[name].copy_(held.source.detach())
        self._pair()

    def _assembled(self, name: str) -> torch.Tensor:
        """The whole average of one parameter on this rank (where it is in slices, every rank of its group calls
        this): ZeRO-3's partitions gathered, fragments summed into zeros (disjoint: the sum is exact)."""
        held, mine, param = self.slices[name], self.average[name], self.params[name]
        if held.group is None:
            return mine
        device = _live(param).device  # where the collective runs (the masters may be offloaded to the CPU)
        if held.partition:
            parts = [torch.empty(mine.numel(), dtype=mine.dtype, device=device)
                     for _ in range(dist.get_world_size(group=held.group))]
            dist.all_gather(parts, mine.to(device), group=held.group)
            return torch.cat(parts)[:param.ds_numel].view(param.ds_shape)  # type: ignore[attr-defined]
        whole = torch.zeros(param.numel(), dtype=mine.dtype, device=device)
        whole.narrow(0, held.start, mine.numel()).copy_(mine)
        dist.all_reduce(whole, group=held.group)
        return whole.view(param.shape)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The module holds the average (in its own dtype) inside the block, its weights again after (every rank
        enters it under ZeRO: the average is assembled or regathered)."""
        saved = {name: _live(p).detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    held = self.slices[name]
                    _live(param).copy_(self.average[name] if held.partition or held.group is None
                                       else self._assembled(name))
                _regather_held(list(self.params.values()))
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    _live(param).copy_(saved[name])
                _regather_held(list(self.params.values()))

    @torch.no_grad()
    def whole(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The average as whole fp32 tensors: where it is in slices (ZeRO, bf16/fp16's masters) assembled one
        parameter at a time (every rank calls it; ``keep``: this rank keeps them, the others return an empty
        dict)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.params:
            tensor = self._assembled(name)
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
            mine, held = self.average[name], self.slices[name]
            if held.group is None:
                mine.copy_(tensor)
            else:  # this rank's slice (ZeRO-3's last partition ends in padding: zeros)
                flat = tensor.reshape(-1)[held.start:held.start + mine.numel()]
                mine.copy_(torch.cat([flat, flat.new_zeros(mine.numel() - flat.numel())]))
        return True
