"""Running one global batch of an objective (``megatron/objectives/``) through the engine, for training or
evaluation: the trainer's step (``step.py``) and its evaluation (``evaluate.py``).

The step knows all of its micro-batches before the first forward: it prepares them, counts their
loss units and all-reduces the count over data-parallel ranks (the normaliser, see ``megatron/objectives/base.py``), asks
the reference for its log-probs, and only then runs the policy - micro-batch by micro-batch through
the plain engine, or as one ``train_batch``/``eval_batch`` schedule through the pipeline, whose last
stage computes the loss with ``Objective.loss`` as the ``PipelineModule``'s ``loss_fn``.

Metrics are summed where the loss is computed (every rank without a pipeline, the last stage with
one), all-reduced over data-parallel ranks and broadcast from the last stage to the other stages, so
every rank returns the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.data.transfer import to_device
from megatron.mpu.cross_entropy import twice_differentiable
from megatron.objectives.base import MicroBatch, Objective, means_from_vector, micro_batch_denominator
from megatron.objectives.reference import Reference
from megatron.engine.levanter_sophia import HessianProbe
from megatron.training.stragglers import timed


def _dp_sum(value: torch.Tensor) -> torch.Tensor:
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(value, group=mpu.get_data_parallel_group())
    return value


def mean_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar over the data-parallel group (identical on every rank afterwards), left on
    its device: no host sync."""
    return _dp_sum(value.detach().float().clone()) / mpu.get_data_parallel_world_size()


def last_stage_rank() -> int:
    """Global rank of the last pipeline stage in this rank's pipeline."""
    topo = mpu.get_topology()
    me = mpu.get_coordinates()
    return int(topo.filter_match(pipe=topo.get_dim("pipe") - 1, data=me.dp, model=me.tp)[0])


class EngineHandle(Protocol):
    """What a runner reads of :class:`megatron.engine.build.Engine` (named by its shape: only these)."""

    engine: Any  # DeepSpeed's DeepSpeedEngine or PipelineEngine: DeepSpeed ships no type information
    is_pipe: bool
    before_update: Callable[[torch.Tensor], None] | None
    after_forward_only: Callable[[], None] | None
    hessian_probe: HessianProbe | None


class ObjectiveRunner:
    """Runs global batches of one objective through one engine (``megatron.engine.build.Engine``)."""

    def __init__(self, objective: Objective, reference: Reference) -> None:
        self.objective = objective
        self.reference = reference

    def prepare(self, samples: list[dict[str, torch.Tensor]], split: str, device: torch.device,
                seq_limit: int | None = None) -> tuple[list[MicroBatch], torch.Tensor]:
        """The step's micro-batches with their reference log-probs, and the loss denominator (a
        device tensor: never read back, so the host runs ahead of the GPU); ``seq_limit``: the first that
        many tokens of every sample (the sequence curriculum)."""
        batches = [self.objective.prepare(s) for s in samples]
        if seq_limit is not None:
            batches = [b.truncated(seq_limit) for b in batches]
        pieces = mpu.get_context_parallel_world_size()
        if pieces > 1:  # each context-parallel rank runs (and counts the loss of) its piece of the sequence
            batches = [b.context_piece(mpu.get_context_parallel_rank(), pieces) for b in batches]
        units = to_device(torch.tensor([sum(b.units for b in batches)], dtype=torch.float64), device)
        denominator = micro_batch_denominator(_dp_sum(units), len(batches), mpu.get_data_parallel_world_size())
        return self.reference.fill(batches, split, device), denominator

    def run(self, eng: EngineHandle, micro_batches: Iterator[dict[str, torch.Tensor]], split: str, device: torch.device,
            train: bool, micro_count: int | None = None, seq_limit: int | None = None) -> torch.Tensor:
        """One global batch of ``micro_count`` micro-batches (None: the engine's accumulation steps), each sample
        cut to ``seq_limit`` tokens when given; returns its loss (the same on every rank) as a 0-dim device tensor,
        unread. Metrics accumulate."""
        engine = eng.engine
        count = int(engine.gradient_accumulation_steps()) if micro_count is None else micro_count
        if eng.is_pipe and count != int(engine.gradient_accumulation_steps()):
            raise ValueError("a pipeline engine runs its configured number of micro-batches per batch")
        samples = timed(lambda: [next(micro_batches) for _ in range(count)])  # this rank's own work (stragglers)
        batches, denominator = self.prepare(samples, split, device, seq_limit)
        if eng.is_pipe:
            items = [(b.to(device).pipe_inputs(), tuple(t.to(device) for t in b.targets(denominator))) for b in batches]
            if train:
                # the loss averaged over micro-batches and data-parallel ranks, broadcast to every stage
                return engine.train_batch(iter(items)).detach().float()
            loss = engine.eval_batch(iter(items)).detach().float()
            if eng.after_forward_only is not None:
                eng.after_forward_only()
            return loss
        losses = []
        if train:
            probe = eng.hessian_probe if eng.hessian_probe is not None and eng.hessian_probe.due() else None
            for i, b in enumerate(batches):
                # the step's last micro-batch is the boundary, whatever micro-batches came before (with a
                # batch schedule DeepSpeed's count of micro steps no longer lines up with the accumulation)
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                b = b.to(device)
                output = timed(lambda: engine(b.inputs, **b.model_kwargs()))  # noqa: B023 - called at once
                loss = self.objective.loss(output, b.targets(denominator))
                engine.backward(loss)
                losses.append(loss.detach())
                if i == len(batches) - 1 and probe is not None:  # Sophia-H: at the weights this update starts from
                    probe.measure(lambda: self._probe_losses(engine.module, batches, denominator, device))
                if i == len(batches) - 1 and eng.before_update is not None:
                    step_loss = mean_over_data_parallel(torch.stack(losses).mean())
                    eng.before_update(step_loss)  # the bad-step rule reads it inside the update
                    engine.step()
                    if probe is not None:
                        probe.deliver()
                    return step_loss
                engine.step()  # applies the update only at the accumulation boundary
            if probe is not None:
                probe.deliver()
        else:
            was_training = engine.module.training
            engine.eval()
            with torch.no_grad():
                for b in batches:
                    b = b.to(device)
                    output = engine(b.inputs, **b.model_kwargs())
                    losses.append(self.objective.loss(output, b.targets(denominator)).detach())
                    if eng.after_forward_only is not None:
                        eng.after_forward_only()  # no backward frees what the checkpointing kept
            if was_training:
                engine.train()
        return mean_over_data_parallel(torch.stack(losses).mean())

    def _probe_losses(self, module: torch.nn.Module, batches: list[MicroBatch], denominator: torch.Tensor,
                      device: torch.device) -> Iterator[torch.Tensor]:
        """The step's micro-batch losses again, through the module itself (no engine bookkeeping) and without
        adding to the objective's metrics."""
        for b in batches:
            b = b.to(device)
            labels, *extras, reference, units = b.targets(denominator)
            with twice_differentiable():
                total, _ = self.objective.loss_sum(module(b.inputs, **b.model_kwargs()), labels, tuple(extras),
                                                   reference)
            yield total / units.to(total.dtype).squeeze()

    def collect_metrics(self, eng: EngineHandle, device: torch.device) -> dict[str, float]:
        """Means of the metrics accumulated since the last call, identical on every rank; resets them."""
        names = tuple(self.objective.metric_names)
        if not names:
            self.objective.metrics.reset()
            return {}
        vector = self.objective.metrics.as_vector(names, device)
        self.objective.metrics.reset()
        _dp_sum(vector)
        if eng.is_pipe and mpu.get_pipe_parallel_world_size() > 1:
            dist.broadcast(vector, src=last_stage_rank(), group=mpu.get_pipe_parallel_group())
        return self.objective.derive(means_from_vector(names, vector.cpu()))
