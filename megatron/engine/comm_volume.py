"""Bytes one rank sends per training step, per parallel group: what ``deepy.py --rehearse N`` shows.

Each collective is counted at the bytes a ring algorithm sends per rank (what NCCL's ring and gloo move): an
all-reduce of ``B`` bytes over ``n`` ranks sends ``2(n-1)/n x B``, a reduce-scatter or an all-gather of a ``B``-byte
buffer ``(n-1)/n x B``, a send its size. ``s`` is the sequence length, ``b`` the micro batch, ``h`` the hidden
size, ``a`` bytes per activation (the compute dtype), ``m`` micro-batches per step, ``t`` tp, ``D`` the ZeRO group
(data-parallel ranks), ``w`` bytes per weight, ``c`` bytes per communicated gradient (``communication_data_type``).

* **tp** (dense transformer blocks, Megatron's split as ``megatron/model`` builds it): per micro-batch a block
  all-reduces ``[s, b, h]`` twice in the forward (the row-parallel outputs of attention and MLP, also with
  ``gpt_j_residual``) and twice in the backward (the gradients of the column-parallel inputs); a recomputed
  block (activation checkpointing) runs its forward again; the vocab-parallel embedding all-reduces its output
  and the vocab-parallel logits the gradient of their input. Under sequence parallelism each all-reduce is an
  all-gather plus a reduce-scatter: the same bytes; the embedding, which splits its all-reduced output over the
  sequence, also all-gathers that output's gradient. ``partition_activations`` all-gathers each checkpointed
  chunk's saved input once more before it is recomputed. The cross-entropy's ``[b, s]`` statistics (1/h of one
  all-reduce) are left out. tests/unit/test_rehearsal.py counts a block's collectives on the fake backend.
* **pp** (DeepSpeed's PipelineEngine, 0.19.8): per micro-batch a stage sends its output to the next stage and the
  gradient of its input to the previous one; with tp > 1 each tp rank sends only its ``1/t`` of the tensor
  (``pipe_partitioned``/``grad_partitioned``, on by default: runtime/config.py:279-280, pipe/engine.py:732-746)
  and the receiving stage all-gathers it over its tp group (counted in the tp row "pipeline regather").
* **dp**, by the optimizer DeepSpeed builds (``zero_shards.deepspeed_optimizer``), once per step unless said:
  without ZeRO an all-reduce of the gradients; the bf16 optimizer an all-reduce of its (padded) gradient buffer,
  then an all-gather of the updated weights; ZeRO-1/2 a reduce-scatter of the gradients (an all-reduce with
  ``reduce_scatter: false``; ZeRO-2 every micro-batch, as it partitions them in the backward) and an all-gather of
  the updated weights; ZeRO-3 every micro-batch an all-gather of the weights for the forward and again for the
  backward (not the persistent ones) and a reduce-scatter of the gradients.
* **tied**: a pipeline whose first and last stages share the embedding all-reduces its gradient between them.

Not counted: context parallelism's all-to-alls, experts' all-to-alls, the objective's metric all-reduces and
DeepSpeed's few scalar ones (loss scale, gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.engine.zero_shards import Elements, Precision

Group = Literal["tp", "pp", "dp", "tied"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShape:
    """The sizes the traffic of one step depends on."""

    tp: int
    stages: int
    dp: int
    """Ranks of the ZeRO (data-parallel) group."""
    replicas: int = 1
    """Hybrid sharding: copies of each ZeRO-3 shard group, whose gradients are all-reduced once a step."""
    micro_batch: int
    seq_length: int
    hidden: int
    micro_batches: int
    """Micro-batches per step (gradient accumulation steps)."""
    activation_bytes: int
    sequence_parallel: bool
    partition_activations: bool
    comm_bytes: int
    """Bytes per gradient element in the data-parallel reduction."""
    reduce_scatter: bool = True
    tp_modelled: str | None = None
    """Why the tp traffic is not counted (None: it is): a layer family or MoE whose collectives differ."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    group: Group
    what: str
    formula: str
    sent: int | None
    """Bytes this rank sends per step (None: not modelled, see ``what``)."""


def _ring(n: int) -> float:
    """Bytes a rank sends per byte of buffer in a ring all-gather or reduce-scatter over ``n`` ranks."""
    return (n - 1) / n


def tensor_parallel(shape: StepShape, blocks: int, recomputed: int, chunks: int, embedding: bool,
                    lm_head: bool, first: bool, last: bool) -> list[Traffic]:
    t, m = shape.tp, shape.micro_batches
    if t == 1:
        return []
    if shape.tp_modelled is not None:
        return [Traffic(group="tp", what=f"activation collectives: not modelled ({shape.tp_modelled})", formula="",
                        sent=None)]
    act = shape.seq_length * shape.micro_batch * shape.hidden * shape.activation_bytes
    count = 4 * blocks + 2 * recomputed + int(embedding) + int(lm_head)
    rows = [Traffic(group="tp", what=f"activation all-reduces: {count} per micro-batch (4 per block, 2 per recomputed "
                                     f"block, embedding {int(embedding)}, logits {int(lm_head)})",
                    formula=f"m x {count} x 2(t-1)/t x s*b*h*a",
                    sent=round(m * count * 2 * _ring(t) * act))]
    if shape.sequence_parallel and embedding:
        # the embedding splits its all-reduced output over the sequence: its gradient is all-gathered back
        rows.append(Traffic(group="tp", what="sequence parallelism: the embedding's output gradient all-gathered",
                            formula="m x (t-1)/t x s*b*h*a", sent=round(m * _ring(t) * act)))
    if shape.partition_activations and chunks:
        rows.append(Traffic(group="tp", what=f"partition_activations: {chunks} checkpointed input(s) all-gathered",
                            formula=f"m x {chunks} x (t-1)/t x s*b*h*a", sent=round(m * chunks * _ring(t) * act)))
    if shape.stages > 1 and (not first or not last):
        boundary = act // t if shape.sequence_parallel else act
        regathers = int(not first) + int(not last)  # the activation received, the gradient received
        rows.append(Traffic(group="tp", what=f"pipeline regather: {regathers} received tensor(s) per micro-batch "
                                             f"all-gathered from the tp ranks' 1/t parts",
                            formula=f"m x {regathers} x (t-1)/t x O", sent=round(m * regathers * _ring(t) * boundary)))
    return rows


def pipeline(shape: StepShape, first: bool, last: bool) -> list[Traffic]:
    if shape.stages == 1:
        return []
    act = shape.seq_length * shape.micro_batch * shape.hidden * shape.activation_bytes
    boundary = act // shape.tp if shape.sequence_parallel else act  # O: the tensor a stage hands on
    sends = int(not last) + int(not first)  # the output forward, the input's gradient backward
    part = boundary // shape.tp  # each tp rank sends its 1/t part (pipe_partitioned, grad_partitioned)
    shown = "O/t" if shape.tp > 1 else "O"
    o = "s*b*h*a/t" if shape.sequence_parallel else "s*b*h*a"
    return [Traffic(group="pp", what=f"sends: {sends} per micro-batch (activation forward, gradient backward), "
                                     f"O = {o}",
                    formula=f"m x {sends} x {shown}", sent=shape.micro_batches * sends * part)]


def data_parallel(shape: StepShape, e: Elements, how: Precision) -> list[Traffic]:
    d, m, c, w = shape.dp, shape.micro_batches, shape.comm_bytes, how.weight_bytes
    rows: list[Traffic] = []
    if d > 1:
        wrapper = how.wrapper
        if wrapper in ("none", "fp16", "bf16_ddp"):
            rows.append(Traffic(group="dp", what="gradient all-reduce", formula="2(D-1)/D x c x T",
                                sent=round(2 * _ring(d) * c * e.trainable)))
        elif wrapper == "bf16":
            rows.append(Traffic(group="dp", what="gradient all-reduce (BF16_Optimizer's padded buffer)",
                                formula="2(D-1)/D x c x padded T", sent=round(2 * _ring(d) * c * e.padded)))
            rows.append(Traffic(group="dp", what="all-gather of the updated weights",
                                formula="(D-1)/D x w x padded T", sent=round(_ring(d) * w * e.padded)))
        elif how.zero_stage in (1, 2):
            times, each = (m, "m x ") if how.zero_stage == 2 else (1, "")
            if shape.reduce_scatter:
                rows.append(Traffic(group="dp", what="gradient reduce-scatter" + (" (every micro-batch)" if times > 1 else ""),
                                    formula=f"{each}(D-1)/D x c x padded T", sent=round(times * _ring(d) * c * e.padded)))
            else:
                rows.append(Traffic(group="dp", what="gradient all-reduce (reduce_scatter: false)",
                                    formula=f"{each}2(D-1)/D x c x padded T",
                                    sent=round(times * 2 * _ring(d) * c * e.padded)))
            rows.append(Traffic(group="dp", what="all-gather of the updated weights",
                                formula="(D-1)/D x w x padded T", sent=round(_ring(d) * w * e.padded)))
        else:  # ZeRO-3
            gathered = (e.owned + e.frozen_owned) * d - e.persistent
            rows.append(Traffic(group="dp", what="weight all-gathers, forward and backward, every micro-batch "
                                                 "(persistent parameters stay whole)",
                                formula="m x 2 x (D-1)/D x w x gathered", sent=round(m * 2 * _ring(d) * w * gathered)))
            rows.append(Traffic(group="dp", what="gradient reduce-scatter, every micro-batch",
                                formula="m x (D-1)/D x c x padded T", sent=round(m * _ring(d) * c * e.padded)))
    if shape.replicas > 1:
        r = shape.replicas
        rows.append(Traffic(group="dp", what=f"hybrid sharding: the shard's gradients all-reduced over {r} replicas",
                            formula="2(R-1)/R x c x [T]", sent=round(2 * _ring(r) * c * e.owned)))
    return rows


def tied(shape: StepShape, tied_elements: int, how: Precision) -> list[Traffic]:
    if shape.stages == 1 or not tied_elements:
        return []
    return [Traffic(group="tied", what="tied embedding: gradient all-reduce between the first and last stage",
                    formula="2(2-1)/2 x w x v/t*h", sent=how.weight_bytes * tied_elements)]
