"""Whole parameters for optimizers that act on them (Levanter's SOAP): from a tensor-parallel slice, and from the
flat fp32 partition a ZeRO optimizer hands its optimizer.

Tensor parallelism: a rank holds chunk ``rank`` of every section of a split parameter along its ``partition_dim``
(``mpu.initialize_weights.shard_tensor``; a fused ``[q; k; v]`` or ``[gate; up]`` has several sections). :func:`tp_whole`
all-gathers the slices over the tp group and puts them back in the model's own order (``unshard_tensors``), so the
whole tensor is the one a tp-1 run holds, rows in the same order (SOAP's blocks cut rows, so a permutation would
change its numbers); :func:`tp_own` is this rank's slice of a whole tensor again. The split is read from the model's
parameter (``set_tensor_model_parallel_attributes``) when the optimizer is built: DeepSpeed's fp32 copies lose it.

ZeRO (DeepSpeed 0.19.8): the optimizer steps one flat fp32 tensor per group, this rank's partition
(:class:`megatron.deepspeed_internals.ZeroMaster` says how the model's parameters lie in it).
:meth:`ZeroWhole.whole` all-gathers a flat tensor (the gradient) over the data-parallel group and cuts the whole
parameters out of it; :meth:`ZeroWhole.shard` flattens whole tensors (the update) back into this rank's partition.
Stages 1 and 2 split the group's flat buffer (the parameters one after another, each aligned) into equal
consecutive partitions (``stage_1_and_2.py``: ``round_robin_bit16_offsets``, ``get_data_parallel_partitions``);
stage 3 splits every parameter into equal consecutive pieces, and a rank's flat tensor is its pieces one after
another (``stage3.py``: ``fp16_groups``, ``partition_numel``). Every data-parallel rank then computes the same
update of every whole parameter (the optimizer's state is whole and replicated: the work and memory ZeRO would save
are spent again), and keeps its own part.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.deepspeed_internals import ZeroMaster, zero_masters
from megatron.mpu.initialize_weights import shard_tensor, unshard_tensors

TPSplit = tuple[int, list[int] | None] | None
"""A parameter's tensor-parallel split: (dim, sections), None when replicated."""


def tp_split(param: torch.Tensor) -> TPSplit:
    """How the model split ``param`` over the tp ranks (None: replicated, or tp 1)."""
    if not getattr(param, "tensor_model_parallel", False) or _tp_world() == 1:
        return None
    sections = getattr(param, "partition_sections", None)
    return int(getattr(param, "partition_dim")), list(sections) if sections else None


def _tp_world() -> int:
    if not mpu.model_parallel_is_initialized():
        return 1
    return int(mpu.get_tensor_model_parallel_world_size())


def tp_whole(shard: torch.Tensor, split: TPSplit) -> torch.Tensor:
    """The whole tensor (the model's order) from every tp rank's ``shard``."""
    if split is None:
        return shard
    dim, sections = split
    parts = [torch.empty_like(shard) for _ in range(_tp_world())]
    dist.all_gather(parts, shard.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return unshard_tensors(parts, dim, sections)


def tp_own(full: torch.Tensor, split: TPSplit) -> torch.Tensor:
    """This tp rank's slice of ``full``."""
    if split is None:
        return full
    dim, sections = split
    return shard_tensor(full, dim, mpu.get_tensor_model_parallel_rank(), _tp_world(), sections)


class ZeroWhole:
    """One ZeRO flat partition and the whole parameters in it (module docstring)."""

    def __init__(self, master: ZeroMaster) -> None:
        self.master = master
        self.world = dist.get_world_size(group=master.group)
        self.rank = dist.get_rank(group=master.group)
        self.splits: list[TPSplit] = [tp_split(p) for p in master.params]

    def _gather(self, flat: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(parts, flat.contiguous(), group=self.master.group)
        return parts

    def whole(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter of the partition, whole (on this tp rank: its tp slice), from each rank's ``flat``."""
        m, parts = self.master, self._gather(flat)
        if not m.stage3:
            buffer = torch.cat(parts)
            return [buffer[o:o + n].view(shape) for o, n, shape in zip(m.offsets, m.numels, m.shapes)]
        return [torch.cat([part[o:o + piece] for part in parts])[:n].view(shape)
                for o, piece, n, shape in zip(m.offsets, m.pieces, m.numels, m.shapes)]

    def shard(self, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """This rank's partition of the flat tensor made of ``tensors`` (zeros in the padding)."""
        m = self.master
        if not m.stage3:
            buffer = torch.zeros(like.numel() * self.world, dtype=like.dtype, device=like.device)
            for t, o, n in zip(tensors, m.offsets, m.numels):
                buffer[o:o + n] = t.reshape(-1)
            return buffer.narrow(0, self.rank * like.numel(), like.numel())
        pieces = []
        for t, piece, n in zip(tensors, m.pieces, m.numels):
            padded = torch.zeros(piece * self.world, dtype=like.dtype, device=like.device)
            padded[:n] = t.reshape(-1)
            pieces.append(padded.narrow(0, self.rank * piece, piece))
        return torch.cat(pieces)


def zero_wholes(masters: Sequence[ZeroMaster]) -> dict[int, ZeroWhole]:
    """``id`` of each flat partition -> its :class:`ZeroWhole`."""
    return {id(m.flat): ZeroWhole(m) for m in masters}


def attach_whole_parameters(ds_optimizer: object) -> None:
    """Tell the optimizer inside DeepSpeed's ZeRO optimizer ``ds_optimizer`` how its flat partitions hold the whole
    parameters, when it asks (an ``attach_zero(masters)`` method: ``LevanterSoap``). Nothing otherwise."""
    attach = getattr(getattr(ds_optimizer, "optimizer", None), "attach_zero", None)
    masters = zero_masters(ds_optimizer)
    if masters and attach is not None:
        attach(masters)
