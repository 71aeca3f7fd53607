"""The trainer's side of MoE layers: the auxiliary losses' gradient scale, router metrics, and the
gradient reduction of experts split over data-parallel ranks.

The training loop reaches all of it through one :class:`MoETraining` object (``Engine.moe``, None
for a dense model): ``before_step`` once per optimizer step, ``metrics`` at each log line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron import mpu
from megatron.deepspeed_internals import wrap_gradient_allreduce
from megatron.model.moe import MoELayer, RouterStats, moe_layers
from megatron.mpu import experts as expert_parallel

# columns of the per-layer statistics table
_FORWARDS, _LBL, _Z, _ENTROPY, _TOKENS, _COUNTS = range(6)


@dataclass
class MoETraining:
    layers: list[MoELayer]
    """This rank's MoE layers (one pipeline stage holds some of them)."""
    num_layers: int
    num_experts: int

    def before_step(self, engine: Any, loss_scale: float | None) -> None:
        """Give the auxiliary losses the gradient scale the engine gives the main loss: DeepSpeed
        divides the loss by the gradient-accumulation steps (and multiplies it by the fp16 loss
        scale) before its backward."""
        scale = (loss_scale or 1.0) / float(engine.gradient_accumulation_steps())
        for layer in self.layers:
            layer.aux_loss_scale = scale

    def metrics(self) -> dict[str, float]:
        """Router statistics since the last call, over every layer, stage and data-parallel rank.

        A collective: every rank must call it. ``train/moe_aux_loss`` and ``train/moe_z_loss`` are
        the unweighted losses (mean over layers and micro-batches; 1.0 = balanced for the former),
        ``moe/router_entropy`` the mean entropy (nats) of a token's routing distribution,
        ``moe/expert_share/<e>`` the share of token-assignments expert e got (over all layers; 1/E
        when balanced) and ``moe/max_expert_share`` the largest share any expert got in one layer.
        """
        table = torch.zeros(self.num_layers, _COUNTS + self.num_experts, dtype=torch.float64,
                            device=self._device())  # fmt: skip
        for layer in self.layers:
            stats, layer.stats = layer.stats, RouterStats()
            lbl, z, entropy, counts = stats.load_balancing, stats.z_loss, stats.entropy, stats.counts
            if stats.forwards == 0 or lbl is None or z is None or entropy is None or counts is None:
                continue  # no training forward since the last read (the sums are set together by add())
            row = table[layer.layer_number]
            row[_FORWARDS], row[_TOKENS] = stats.forwards, stats.tokens
            row[_LBL], row[_Z], row[_ENTROPY] = lbl, z, entropy
            row[_COUNTS:] = counts
        for group, size in ((mpu.get_pipe_parallel_group(), mpu.get_pipe_parallel_world_size()),
                            (mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size())):
            if size > 1:
                dist.all_reduce(table, group=group)
        rows = table[table[:, _FORWARDS] > 0]
        if rows.shape[0] == 0:
            return {}
        forwards = rows[:, _FORWARDS].sum()
        counts = rows[:, _COUNTS:]
        share = counts.sum(0) / counts.sum()
        out = {
            "train/moe_aux_loss": float(rows[:, _LBL].sum() / forwards),
            "train/moe_z_loss": float(rows[:, _Z].sum() / forwards),
            "moe/router_entropy": float(rows[:, _ENTROPY].sum() / rows[:, _TOKENS].sum()),
            "moe/max_expert_share": float((counts / counts.sum(1, keepdim=True)).max()),
        }
        out.update({f"moe/expert_share/{e}": float(value) for e, value in enumerate(share)})
        return out

    def _device(self) -> torch.device:
        return self.layers[0].router.weight.device if self.layers else torch.device("cpu")


def build_moe_training(model: nn.Module, num_layers: int, num_experts: int) -> MoETraining | None:
    """None for a dense model. Every rank of an MoE model gets one (a pipeline stage without MoE
    layers still takes part in the metric reductions)."""
    if num_experts <= 1:
        return None
    return MoETraining(layers=moe_layers(model), num_layers=num_layers, num_experts=num_experts)


# --- experts split over data-parallel ranks ------------------------------------------------------
def expert_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    return expert_parallel.split_expert_parallel(model.parameters())[1]


@contextlib.contextmanager
def keep_expert_shards(model: nn.Module) -> Iterator[None]:
    """``deepspeed.initialize`` broadcasts every parameter from data-parallel rank 0 so replicas
    start equal; experts split over data-parallel ranks are not replicas and keep their own values."""
    with expert_parallel.preserved(expert_parallel_params(model)):
        yield


def install_expert_parallel(engine: Any) -> None:
    """Reduce expert gradients over the ranks holding the same experts, and keep DeepSpeed's
    data-parallel all-reduce (ZeRO stage 0, what the config rules allow) off them.

    DeepSpeed's own expert support would need its MoE layer class (``deepspeed.moe.layer.MoE``)
    and brings its per-expert checkpoint format; its reduction entry point is wrapped instead, the
    one place both the plain and the pipeline engine reduce gradients.
    """
    params = expert_parallel_params(engine.module)
    if not params:
        return

    def around(reduce_dense: Callable[..., None]) -> Callable[..., None]:
        def allreduce_gradients(*args: Any, **kwargs: Any) -> None:
            if engine.is_gradient_accumulation_boundary():
                expert_parallel.reduce_expert_gradients(params)
            with expert_parallel.hidden_from_reduction(params):
                reduce_dense(*args, **kwargs)

        return allreduce_gradients

    wrap_gradient_allreduce(engine, around)
