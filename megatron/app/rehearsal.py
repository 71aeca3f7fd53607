"""``deepy.py --rehearse N``: a launch of ``N`` ranks checked and shown on this machine, without training.

``deepy.py`` resolves the config as a launch does, with the world size ``N`` instead of the ranks this machine
would start (``resolve(command, world=N)``): every rule that depends on the world size runs at ``N``, and a layout
it refuses is the usual one-line config error (exit code 2). Then this module shows what the ``N`` ranks would
hold and send:

* the pipeline stages as DeepSpeed's ``PipelineModule`` partitions them, and each distinct (stage, tp rank)
  partition of the model as the ranks build it (megatron/engine/rehearsal.py: the engine's own
  ``build_model`` on the meta device, this process being rank ``r`` of ``N`` on torch's fake process group);
* every rank's parameters and the bytes of weights, gradients, master weights and optimizer states it holds once
  DeepSpeed 0.19.8 has wrapped the optimizer (megatron/engine/zero_shards.py), ranks with the same figures in
  one row;
* the bytes each rank sends per step in its tp, pp and dp groups, with the formula of each
  (megatron/engine/comm_volume.py);
* the memory estimate per device of the dry run (megatron/engine/memory.py), and its refusal when
  ``device_memory_gb`` says the estimate does not fit.

The launch itself (hosts, ports, tools, the save lock) is the cluster's, not checked here. docs/rehearsal.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import deepspeed

from megatron.engine.comm_volume import StepShape, Traffic, data_parallel, pipeline, tensor_parallel, tied
from megatron.engine.memory import GiB, MemoryFit, memory_fit
from megatron.engine.rehearsal import Partition, build_partitions, rank_of
from megatron.engine.zero_shards import WRAPPER_NAMES, Elements, Holding, Precision, elements, holding
from megatron.neox_arguments.run_config import RunConfig

if TYPE_CHECKING:
    from megatron.neox_arguments.resolved import ResolvedConfig

DEEPSPEED_READ = "0.19.8"
"""The DeepSpeed whose partitioning zero_shards.py and comm_volume.py restate."""


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """What ``N`` ranks would build, hold and send."""

    world: int
    run: RunConfig
    fit: MemoryFit
    how: Precision
    shape: StepShape
    partitions: list[Partition]
    elements: dict[tuple[int, int], Elements]
    """(stage, tp rank) -> its optimizer's layout."""
    seconds: float
    """Time spent building the partitions."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks of each (stage, tp rank), context-parallel ones included."""
        return self.world // (self.run.parallel.model_parallel_size * self.run.parallel.pipe_stages)

    def holding(self, p: Partition) -> Holding:
        return holding(self.elements[(p.stage, p.tp_rank)], self.how)

    def ranks(self, p: Partition) -> list[int]:
        return [rank_of(self.run, self.world, p.stage, p.tp_rank, d) for d in range(self.dp)]

    def traffic(self, p: Partition) -> list[Traffic]:
        stages = self.run.parallel.pipe_stages
        first, last = p.stage == 0, p.stage == stages - 1
        e = self.elements[(p.stage, p.tp_rank)]
        return [*tensor_parallel(self.shape, len(p.blocks), p.recomputed_blocks, p.recomputed_chunks, p.has_embedding,
                                 p.has_lm_head, first, last),
                *pipeline(self.shape, first, last), *data_parallel(self.shape, e, self.how),
                *tied(self.shape, p.tied_embedding, self.how)]


def precision_of(fit: MemoryFit, zero: dict[str, object]) -> Precision:
    """The optimizer's byte sizes, read as the memory estimate reads them (its ``MemoryLayout``)."""
    layout = fit.layout
    return Precision(precision=layout.precision, zero_stage=layout.zero_stage, pipeline=layout.pipeline_engine,
                     grad_accum_bytes=layout.grad_accum_bytes, offload=layout.offload_optimizer,
                     optimizer_states=layout.optimizer_states, master_bytes=layout.master_bytes,
                     state_bytes=layout.state_bytes,
                     persistence_threshold=int(float(str(zero.get("stage3_param_persistence_threshold", 1e5)))),
                     **({"model_persistence_threshold": int(float(str(zero["stage3_model_persistence_threshold"])))}
                        if "stage3_model_persistence_threshold" in zero else {}))


_COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def shape_of(run: RunConfig, fit: MemoryFit, world: int) -> StepShape:
    layout, ds = fit.layout, run.deepspeed_config
    zero = ds.get("zero_optimization") or {}
    parallel = run.parallel
    dp = world // (parallel.model_parallel_size * parallel.pipe_stages)
    shard = parallel.sharding_group_size if layout.zero_stage == 3 and parallel.sharding_group_size else None
    comm = ds.get("communication_data_type")
    model = layout.model
    why = None
    if set(model.layer_families) != {"transformer"}:
        why = f"{', '.join(sorted(set(model.layer_families) - {'transformer'}))} blocks"
    elif model.moe_num_experts > 1:
        why = "mixture-of-experts layers"
    return StepShape(tp=layout.tp, stages=parallel.pipe_stages, dp=shard or dp, replicas=dp // shard if shard else 1,
                     micro_batch=layout.micro_batch, seq_length=layout.seq_length, hidden=model.arch.hidden,
                     micro_batches=layout.grad_accum, activation_bytes=_COMM_BYTES[layout.precision],
                     sequence_parallel=layout.sequence_parallel and layout.tp > 1,
                     partition_activations=run.activation_config.partition_activations,
                     comm_bytes=_COMM_BYTES.get(str(comm), layout.grad_accum_bytes or _COMM_BYTES[layout.precision]),
                     reduce_scatter=bool(zero.get("reduce_scatter", True)), tp_modelled=why)


def rehearsal_of(resolved: ResolvedConfig, world: int) -> Rehearsal:
    """Build and count every distinct partition of the resolved run at ``world`` ranks."""
    run = RunConfig.from_resolved(resolved)
    fit = memory_fit(run, launches_locally=False)  # the ranks run elsewhere: no host memory of this machine
    zero = dict(run.deepspeed_config.get("zero_optimization") or {})
    how, shape = precision_of(fit, zero), shape_of(run, fit, world)
    start = time.perf_counter()
    partitions = build_partitions(run, fit.layout.model, world)
    seconds = time.perf_counter() - start
    laid_out = {(p.stage, p.tp_rank): elements(p.groups, p.params, shape.dp, how) for p in partitions}
    return Rehearsal(world=world, run=run, fit=fit, how=how, shape=shape, partitions=partitions, elements=laid_out,
                     seconds=seconds)


def rehearse(resolved: ResolvedConfig, user_script: str, given: str, world: int,
             check_memory: Callable[[ResolvedConfig, MemoryFit, str], None], notes: Sequence[str]) -> int:
    """``deepy.py --rehearse N USER_SCRIPT <given>`` after ``resolve(command, world=N)``: refuse what a launch
    refuses (``check_memory``: deepy.py's refusal of an estimate over ``device_memory_gb``), show the rest with
    deepy.py's ``notes``."""
    started = time.perf_counter()
    rehearsal = rehearsal_of(resolved, world)
    check_memory(resolved, rehearsal.fit, user_script)
    print(render(rehearsal, user_script, given, notes, time.perf_counter() - started), flush=True)
    return 0


# --- the report -------------------------------------------------------------------------------------------------
def spans(values: Sequence[int]) -> str:
    """``0-7,16,18-19``: sorted integers as ranges."""
    out: list[str] = []
    ordered = sorted(set(values))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _layers(p: Partition) -> str:
    """``EmbeddingPipe + 6 x TransformerLayerPipe + FinalNormPipe``: a stage's layers, runs counted."""
    runs: list[tuple[str, int]] = []
    for name in p.modules:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    return " + ".join(name if n == 1 else f"{n} x {name}" for name, n in runs)


def stage_lines(r: Rehearsal) -> list[str]:
    tp = r.run.parallel.model_parallel_size
    rows = []
    for stage in range(r.run.parallel.pipe_stages):
        parts = [p for p in r.partitions if p.stage == stage]
        blocks = parts[0].blocks
        shown = spans(blocks) if blocks else "-"
        rows.append((str(stage), _layers(parts[0]), f"{len(blocks)}", shown, f"{parts[0].parameters:,}",
                     f"{sum(p.parameters for p in parts):,}"))
    total_blocks = sum(len(p.blocks) for p in r.partitions if p.tp_rank == 0)
    total = sum(p.parameters for p in r.partitions)
    rows.append(("total", "", f"{total_blocks}", "", "", f"{total:,}"))
    header = ("stage", "layers", "blocks", "layer numbers", "params / tp rank", f"params (x tp={tp})")
    lines = _table(header, rows, right={2, 4, 5})
    sizes = [sum(p.parameters for p in r.partitions if p.stage == s) for s in range(r.run.parallel.pipe_stages)]
    if len(sizes) > 1:
        mean = sum(sizes) / len(sizes)
        lines.append(f"  balance: the largest stage holds {max(sizes) / mean:.3f} x the mean stage's parameters "
                     f"(pipe_partition_method={r.run.parallel.pipe_partition_method})")
    return lines


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [f"{cell:>{widths[i]}}" if i in right else f"{cell:<{widths[i]}}" for i, cell in enumerate(row)]
        return ("  " + "  ".join(cells)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _bytes(n: int) -> str:
    return f"{n:,} ({n / GiB:.2f} GiB)"


def holding_lines(r: Rehearsal) -> list[str]:
    """One row per set of ranks with the same figures (per stage, any tp rank, any dp rank, as it comes out)."""
    grouped: dict[Holding, list[Partition]] = {}
    for p in r.partitions:
        grouped.setdefault(r.holding(p), []).append(p)
    rows = []
    for held, parts in sorted(grouped.items(), key=lambda item: (item[1][0].stage, item[1][0].tp_rank)):
        ranks = [rank for p in parts for rank in r.ranks(p)]
        rows.append((spans(ranks), spans([p.stage for p in parts]), spans([p.tp_rank for p in parts]),
                     f"0-{r.dp - 1}" if r.dp > 1 else "0", f"{len(ranks)}", f"{held.parameters:,}",
                     _bytes(held.weights), _bytes(held.gradients), _bytes(held.master_weights),
                     _bytes(held.optimizer_states)))
    header = ("ranks", "stage", "tp", "dp", "count", "parameters", f"weights ({r.how.precision})", "gradients",
              "master weights", f"optimizer states ({r.how.optimizer_states})")
    lines = _table(header, rows, right={4, 5, 6, 7, 8, 9})
    if r.how.offload:
        lines.append("  (offload_optimizer: master weights and optimizer states are in CPU memory)")
    return lines


def traffic_lines(r: Rehearsal) -> list[str]:
    grouped: dict[tuple[Traffic, ...], list[Partition]] = {}
    for p in r.partitions:
        grouped.setdefault(tuple(r.traffic(p)), []).append(p)
    lines: list[str] = []
    for rows, parts in sorted(grouped.items(), key=lambda item: (item[1][0].stage, item[1][0].tp_rank)):
        ranks = [rank for p in parts for rank in r.ranks(p)]
        lines.append(f"  ranks {spans(ranks)} (stage {spans([p.stage for p in parts])}, "
                     f"tp {spans([p.tp_rank for p in parts])}):")
        if not rows:
            lines.append("    none (one rank, nothing to exchange)")
        width = max((len(t.formula) for t in rows), default=0)
        for t in rows:
            sent = "not modelled" if t.sent is None else _bytes(t.sent)
            lines.append(f"    {t.group:<4} {t.formula:<{width}}  = {sent:>28}  {t.what}")
        known = [t.sent for t in rows if t.sent is not None]
        if known:
            lines.append(f"    {'all':<4} {'':<{width}}  = {_bytes(sum(known)):>28}")
    return lines


def render(r: Rehearsal, user_script: str, given: str, notes: Sequence[str], seconds: float) -> str:
    run, layout, shape = r.run, r.fit.layout, r.shape
    parallel = run.parallel
    cp = parallel.context_parallel_size
    dp_line = f"dp {r.dp // cp} x cp {cp}" if cp > 1 else f"dp {r.dp}"
    version = deepspeed.__version__
    read = "" if version == DEEPSPEED_READ else f" (installed: {version}; the layout was read from {DEEPSPEED_READ})"
    zero = f"ZeRO-{layout.zero_stage}"
    if shape.replicas > 1:
        zero += f" in shard groups of {shape.dp} x {shape.replicas} replicas (sharding_strategy: hsdp)"
    batch = run.training.batch.on(r.dp // cp)  # context-parallel ranks read the same samples
    parts = [
        f"deepy: rehearsal of {user_script} at {r.world:,} ranks with {given}",
        f"every config check of a launch of {r.world:,} ranks passed; nothing was launched and no GPU used: each "
        f"distinct part of the model was built by the training code on the meta device, this process being one "
        f"rank of {r.world:,} on torch's fake process group ({len(r.partitions)} builds, {r.seconds:.1f} s)",
        "",
        f"Layout: {r.world:,} ranks = tp {parallel.model_parallel_size} x pp {parallel.pipe_stages} x {dp_line}; "
        f"{layout.precision}, {zero}; the optimizer as DeepSpeed {DEEPSPEED_READ} wraps it: "
        f"{WRAPPER_NAMES[r.how.wrapper]}{read}",
        f"Step: global batch {batch.global_size:,} = micro batch {batch.micro} x {batch.gas} micro-batch(es) x "
        f"dp {batch.dp}, seq_length {layout.seq_length:,}",
        "",
        "Pipeline stages (as PipelineModule partitions the layers; parameters per tp rank, and summed over the tp "
        "ranks, the norms and biases each of them holds counted on each):"
        if parallel.uses_pipeline_module else "The model (no pipeline: one GPTModel per rank):",
        *stage_lines(r),
        "",
        f"Per rank, in bytes (ranks with the same figures share a row; ZeRO parts padded as DeepSpeed "
        f"{DEEPSPEED_READ} pads them, every data-parallel rank's part the same size):",
        *holding_lines(r),
        "",
        f"Communication per step per rank, bytes sent (ring collectives; m={shape.micro_batches}, "
        f"s={shape.seq_length}, b={shape.micro_batch}, h={shape.hidden}, a={shape.activation_bytes}, "
        f"t={shape.tp}, D={shape.dp}, c={shape.comm_bytes}, w={r.how.weight_bytes}; formulas in docs/rehearsal.md):",
        *traffic_lines(r),
        "",
        r.fit.report(),
        "",
        *[f"deepy: {line}" for line in notes],
        "deepy: not checked here: the launch command (hosts, ports, tools) and the save lock: they are the cluster's",
        f"deepy: rehearsal OK, nothing launched ({seconds:.1f} s)",
    ]
    return "\n".join(parts)
