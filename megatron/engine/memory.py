"""How much memory one device needs for a layout: the estimate ``deepy.py --dry-run`` prints.

Per device, for the pipeline stage with the most parameters:

- **parameters** ``P`` of the stage (tensor-parallel weights split by tp, norms replicated), at the
  training dtype;
- **gradients**, **fp32 master weights** and **optimizer states**, as DeepSpeed 0.19.8 lays them
  out (its ``_do_optimizer_sanity_check`` picks the optimizer; measured on CPU for fp32 and bf16,
  ZeRO 0-1, see tests/distributed/test_memory_estimate.py):

  ==============================  ==========  ==============  ================  ==================
  what                            weights     gradients       fp32 master       optimizer states
  ==============================  ==========  ==============  ================  ==================
  fp32, ZeRO-0                    4P          4P              (the weights)     4kP
  bf16/fp16, ZeRO-0               2P          2P              4P                4kP
  bf16 pipeline, ZeRO-0           2P          (4+2)P          4P                4kP
  ZeRO-1                          wP          wP              4P/dp             4kP/dp
  bf16 ZeRO-1, fp32 accumulation  2P          (4+2)P          4P/dp             4kP/dp
  ZeRO-2                          wP          gP/dp           4P/dp             4kP/dp
  ZeRO-3                          wP/dp       gP/dp           4P/dp             4kP/dp
  ==============================  ==========  ==============  ================  ==================

  (``w`` bytes per weight, ``g`` bytes per accumulated gradient: 4 with ``data_types.grad_accum_dtype:
  fp32``, which Deepy sets for bf16 under ZeRO, else ``w``; ``k`` fp32 state tensors per parameter:
  Adam 2, Lion 1, SGD with momentum 1; ``offload_optimizer`` moves master weights and states to CPU
  memory). ZeRO-1 keeps every gradient whole until the accumulation boundary (it reduces them after
  the backward, not during it), and DeepSpeed's bf16 optimizer (a pipeline's, and ZeRO-1's with fp32
  accumulation) keeps a whole fp32 gradient buffer besides the bf16 gradients of the backward;
- **ZeRO buckets**: with ``contiguous_gradients`` (DeepSpeed's default) ZeRO allocates a gradient
  bucket of ``reduce_bucket_size`` elements (two with ``overlap_comm``) while the backward runs —
  2 GB in fp32 at the default 5e8, whatever the model size;
- **activations** kept for the backward, counted tensor by tensor for one micro-batch (the same
  count gives Korthikanti et al.'s 34·s·b·h bytes for a GPT layer in 16 bits), times the micro-batches
  a pipeline's first stage holds in flight; with activation checkpointing a recomputed layer keeps
  only its input, plus one layer's activations while it is recomputed; plus the logits. Attention
  scores count only where SDPA falls back to its math kernel (:func:`sdpa_kernel`: the fused
  kernels do not keep them) and an RMSNorm in 16 bits keeps its fp32 input; ``z_loss`` adds nothing
  of the logits' size (its ``log Z`` comes out of the cross-entropy's own chunked pass).

With LoRA adapters (``lora_r > 0``) the base weights are frozen: they keep only their ``wP`` (``wP/dp``
under ZeRO-3, which partitions frozen weights too), while gradients, fp32 master weights and
optimizer states are counted for the ``T`` trainable parameters of the stage only (the adapters, split
over tp like their layers, plus a reward model's head); each adapter keeps ``r`` numbers per token for
its backward.

Not counted: the CUDA context and allocator fragmentation (typically 1-3 GiB on a GPU), and
temporaries inside the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from megatron import devices
from megatron.model.config import GPTConfig
from megatron.model.family_config import replicated_layer_parameters
from megatron.model.flops import embedding_parameters, final_norm_parameters, layer_parameters, norm_parameters, num_parameters
from megatron.model.norms import norm_entry
from megatron.model.transformer_options import NORM_PLACEMENTS
from megatron.model.transformer_options import POSITIONAL
from megatron.model.lora_config import LoRAArgs
from megatron.tokenizer import build_tokenizer
from megatron.engine.config import compute_dtype
from megatron.engine.zero_shards import WEIGHT_BYTES, deepspeed_optimizer

if TYPE_CHECKING:
    from megatron.engine.engine_config import EngineConfig

GiB = 1024**3

# fp32 state tensors per parameter, by optimizer type (lower-cased)
_STATE_TENSORS: dict[str, int] = {"adam": 2, "adamw": 2, "cpu_adam": 2, "cpuadam": 2, "cpu_torch_adam": 2,
                                  "lamb": 2, "lion": 1, "sgd": 1, "adopt": 2,
                                  "rmsprop_momentum": 2, "rmspropmomentum": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLayout:
    """Everything the estimate depends on, read from the run (see :meth:`from_run`)."""

    model: GPTConfig
    tp: int
    pp: int
    """Pipeline stages (1 for ``pipe_parallel_size`` 0 or 1)."""
    dp: int
    precision: str
    """``fp32``, ``bf16`` or ``fp16``."""
    zero_stage: int
    offload_optimizer: bool
    contiguous_gradients: bool
    overlap_comm: bool
    reduce_bucket_size: int
    optimizer_states: int
    micro_batch: int
    seq_length: int
    grad_accum: int
    recomputed_layers: int
    """Transformer layers of the largest stage whose activations are recomputed."""
    checkpoint_chunk: int = 1
    """Blocks recomputed together (``checkpoint_num_layers``): one saved input per chunk, and a whole
    chunk's activations alive while it is recomputed."""
    sequence_parallel: bool
    dropout: bool
    pipeline_engine: bool = False
    """DeepSpeed's PipelineEngine (``pipe_parallel_size >= 1``), whose bf16 optimizer keeps fp32 gradients."""
    grad_accum_bytes: int | None = None
    """Bytes per accumulated gradient element (``data_types.grad_accum_dtype``); None = the weights'."""
    lora: LoRAArgs = field(default_factory=LoRAArgs)
    """Adapters (``r == 0``: none, every parameter trains)."""
    master_bytes: int = 4
    """Bytes per element of ZeRO's master weights: 2 with the bf16 block's ``bf16_master_weights_and_grads``."""
    state_bytes: int = 4
    """Bytes per element of the optimizer's states: 2 with ``bf16_optimizer_states`` (they follow the master)."""

    @classmethod
    def from_run(cls, run: EngineConfig, world_size: int, padded_vocab_size: int) -> MemoryLayout:
        model = run.model.with_vocab(padded_vocab_size)
        tp = run.parallel.model_parallel_size
        pp = run.parallel.pipe_stages
        zero: Mapping[str, Any] = run.deepspeed_config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0) or 0)
        offload = zero.get("offload_optimizer") or {}
        kind = run.optimizer_config.optimizer_kind
        states = _STATE_TENSORS.get(kind, 2)
        if kind == "sgd" and not float(run.optimizer_config.optimizer_params.get("momentum", 0.0) or 0.0):
            states = 0
        layers_per_stage = math.ceil(model.arch.layers / pp)
        ckpt = run.activation_config
        if ckpt.selective_checkpointing:
            recomputed = len([i for i in range(layers_per_stage) if i % ckpt.selective_checkpointing == 0])
        else:
            recomputed = layers_per_stage if ckpt.checkpoint_activations else 0
        chunk = 1 if ckpt.selective_checkpointing else min(ckpt.checkpoint_num_layers, max(layers_per_stage, 1))
        shared = run.engine
        accum = (run.deepspeed_config.get("data_types") or {}).get("grad_accum_dtype")
        bf16: Mapping[str, Any] = run.deepspeed_config.get("bf16") or {}
        return cls(
            model=model, tp=tp, pp=pp, dp=max(world_size // (tp * pp), 1),
            precision=compute_dtype(shared.precision), zero_stage=stage,
            offload_optimizer=stage > 0 and str(offload.get("device", "none")).lower() in ("cpu", "nvme"),
            # DeepSpeed's defaults: contiguous gradients on; overlap_comm only for ZeRO-3
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            reduce_bucket_size=int(float(zero.get("reduce_bucket_size", 5e8))),
            optimizer_states=states,
            micro_batch=shared.batch.micro,
            seq_length=shared.seq_length,
            grad_accum=shared.batch.gas,
            recomputed_layers=recomputed,
            checkpoint_chunk=chunk,
            sequence_parallel=run.parallel.sequence_parallel,
            dropout=bool(model.hidden_dropout or model.attention_dropout),
            lora=run.lora,
            pipeline_engine=run.parallel.pipe_parallel_size >= 1,
            grad_accum_bytes=WEIGHT_BYTES.get(str(accum)) if accum else None,
            # DeepSpeed honours these two under ZeRO 1-3 only (runtime/config.py:706-714 in 0.19.8)
            master_bytes=2 if stage > 0 and bf16.get("bf16_master_weights_and_grads") else 4,
            state_bytes=2 if stage > 0 and bf16.get("bf16_optimizer_states") else 4,
        )  # fmt: skip


# --- parameter counts on one device ------------------------------------------------------------------
def _replicated_in_layer(c: GPTConfig) -> int:
    """Parameters of one layer that tensor parallelism does not split (its family entry's count: a
    transformer layer's norms and the biases added after the row-parallel projections)."""
    return replicated_layer_parameters(c, c.attention_types[0], lambda dim: norm_parameters(c, dim))


def stage_parameters(layout: MemoryLayout) -> int:
    """Parameters on one device of the stage that holds the most (the counts of ``megatron/model/flops.py``)."""
    c, tp = layout.model, layout.tp
    rep = _replicated_in_layer(c)
    per_layer = (layer_parameters(c) - rep) // tp + rep
    layers = math.ceil(c.arch.layers / layout.pp) * per_layer
    vocab = c.vocab * c.arch.hidden // tp
    positions = embedding_parameters(c) - c.vocab * c.arch.hidden  # the positional entry's table, replicated
    first = vocab + positions + layers
    head = c.arch.hidden if c.value_head else vocab
    last_extra = final_norm_parameters(c) + (head if (c.no_weight_tying or c.value_head or layout.pp > 1) else 0)
    if layout.pp == 1:
        return first + last_extra
    return max(first, layers + last_extra)


def _adapted_projections(c: GPTConfig) -> dict[str, tuple[int, int, bool]]:
    """projection -> (in, out, column-parallel) of one layer."""
    q, kv = c.arch.heads * c.head_dim, c.kv_heads * c.head_dim
    first = c.mlp_widths.first
    return {"query_key_value": (c.arch.hidden, q + 2 * kv, True), "dense": (q, c.arch.hidden, False),
            "dense_h_to_4h": (c.arch.hidden, first, True), "dense_4h_to_h": (c.ffn_hidden_size, c.arch.hidden, False)}


def _adapter_pieces(c: GPTConfig, lora: LoRAArgs, name: str) -> int:
    """How many rank-r adapters one projection's adapter is: its sections with ``lora_split_fused``, else 1."""
    if not lora.lora_split_fused:
        return 1
    if name == "query_key_value":
        return 3
    return 2 if name == "dense_h_to_4h" and c.mlp_widths.first == 2 * c.ffn_hidden_size else 1


def adapter_parameters(layout: MemoryLayout) -> int:
    """LoRA parameters on one device of the stage with the most layers: per projection ``A`` ``[r, in]``
    and ``B`` ``[out, r]``, the factor on the layer's split side divided by tp."""
    r, tp = layout.lora.lora_r, layout.tp
    if r == 0:
        return 0
    per_layer = 0
    for name, (d_in, d_out, column) in _adapted_projections(layout.model).items():
        if name in layout.lora.lora_target_modules:
            pieces = _adapter_pieces(layout.model, layout.lora, name)
            per_layer += pieces * r * d_in + d_out * r // tp if column else r * d_in // tp + d_out * r
    # the untied head's adapter (on the last stage): A [r, h] replicated, B [vocab/tp, r]
    head = 0
    if "output_layer" in layout.lora.lora_target_modules:
        head = r * layout.model.arch.hidden + layout.model.vocab * r // tp
    return math.ceil(layout.model.arch.layers / layout.pp) * per_layer + head


def trainable_parameters(layout: MemoryLayout) -> int:
    """Parameters the optimizer holds on one device: all of the stage's, or its adapters (and a reward head)."""
    if not layout.lora.lora_enabled:
        return stage_parameters(layout)
    return adapter_parameters(layout) + (layout.model.arch.hidden if layout.model.value_head else 0)


# --- the estimate ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    parameters: int
    weights: float
    gradients: float
    master_weights: float
    optimizer_states: float
    offloaded: float
    """Master weights and states moved to CPU memory by offload_optimizer."""
    zero_buckets: float
    activations: float

    @property
    def model_states(self) -> float:
        """Weights, gradients, master weights and optimizer states on the device."""
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.zero_buckets + self.activations


SdpaKernel = Literal["flash", "efficient", "math"]


def sdpa_kernel(c: GPTConfig, precision: str, seq_length: int) -> SdpaKernel:
    """The CUDA kernel torch's SDPA picks for the model's attention (torch 2.x's dispatch rules, as
    ``megatron/model/attention.py`` calls it): flash needs 16 bits, no mask and a head dim of at most
    256; the memory-efficient kernel takes masks and fp32 but not SDPA's grouped-query flag (Deepy
    repeats the kv heads where a mask is needed, so only fp32 GQA without a mask misses it); both need
    the head dim aligned (8 elements in 16 bits, 4 in fp32). The math kernel is what is left, and it
    keeps the ``[b, n, s, s]`` probabilities for its backward."""
    half = precision != "fp32"
    if c.head_dim % (8 if half else 4) or c.attn_logit_softcapping is not None:
        return "math"  # soft-capped scores are computed outside SDPA, keeping the probabilities like its math kernel
    windows = [c.attention_window(i) for i in range(c.arch.layers)]
    cuts = any(w is not None and w < seq_length - 1 for w in windows)
    masked = cuts or POSITIONAL[c.pos_emb].additive_bias
    if half and not masked and c.head_dim <= 256:
        return "flash"
    if c.kv_heads != c.arch.heads and not masked:
        return "math"
    return "efficient"


def activation_bytes(layout: MemoryLayout) -> float:
    c, s, b, t = layout.model, layout.seq_length, layout.micro_batch, layout.tp
    h, ffn = c.arch.hidden, c.ffn_hidden_size
    a = WEIGHT_BYTES[layout.precision]
    # RMSNorm normalises an fp32 copy of its input, which autograd keeps (torch's rms_norm saves it)
    fp32_norm_input = 4 if norm_entry(c.norm_settings).keeps_fp32_input and a < 4 else 0
    kv = c.kv_heads * c.head_dim
    first = c.mlp_widths.first
    # tensors a layer keeps for its backward (elements per token): norm inputs and outputs are whole
    # hidden states (split by tp only under sequence parallelism); q/k/v, attention output and the
    # MLP's inner activations are split by tp
    norms = NORM_PLACEMENTS[c.norm_placement].norms_per_layer  # 2 (pre, post), 4 (sandwich)
    replicated = 2 * norms * h  # each norm's input/output
    split = (c.arch.heads * c.head_dim + 2 * kv) + c.arch.heads * c.head_dim + first + ffn
    per_token = (replicated / t if layout.sequence_parallel else replicated) + split / t
    layer = s * b * per_token * a
    layer += norms * s * b * h * fp32_norm_input / (t if layout.sequence_parallel else 1)
    if layout.dropout:
        layer += 2 * s * b * h  # one-byte masks of the two residual dropouts
    if sdpa_kernel(c, layout.precision, s) == "math":
        # the softmax probabilities (and, with attention dropout, its mask and the dropped copy)
        probs = b * (c.arch.heads // t) * s * s
        layer += probs * (a + (1 + a if c.attention_dropout else 0))
    layers = math.ceil(c.arch.layers / layout.pp)
    recomputed, chunk = layout.recomputed_layers, layout.checkpoint_chunk
    # one saved input per checkpointed chunk, plus the full activations of the chunk being recomputed
    stored = (layers - recomputed) * layer + math.ceil(recomputed / chunk) * s * b * h * a
    if recomputed:
        stored += min(chunk, recomputed) * layer
    lora = layout.lora
    adapters = sum(_adapter_pieces(c, lora, name) for name in _adapted_projections(c)
                   if name in lora.lora_target_modules) if lora.lora_r else 0
    stored += layers * adapters * s * b * lora.lora_r * a  # each adapter's rank-r product
    in_flight = min(layout.pp, layout.grad_accum) if layout.pp > 1 else 1
    logits = s * b * c.vocab / t * (a + 4)  # logits and the fp32 copy the loss works on
    final_norm = s * b * h * fp32_norm_input / (t if layout.sequence_parallel else 1)
    return stored * in_flight + logits + s * b * h * a + final_norm


def gradient_bytes(layout: MemoryLayout, trainable: int) -> float:
    """Gradients on one device at their peak, by the optimizer DeepSpeed 0.19.8 builds (module doc)."""
    w, dp, stage = WEIGHT_BYTES[layout.precision], layout.dp, layout.zero_stage
    accum = layout.grad_accum_bytes or w
    wrapper = deepspeed_optimizer(layout.precision, stage, layout.pipeline_engine, layout.grad_accum_bytes,
                                  layout.offload_optimizer)
    if wrapper == "bf16":
        # its whole fp32 gradient buffer, and the bf16 gradients of the backward, which it adds into
        # the buffer only after the backward (bf16.immediate_grad_update is off by default)
        return (4.0 + w) * trainable
    if stage <= 1:
        return float(w * trainable)  # ZeRO-1 reduces (and partitions) them only after the backward
    return accum * trainable / dp


_NAME = {4: "fp32", 2: "bf16"}


def estimate(layout: MemoryLayout) -> MemoryEstimate:
    p = stage_parameters(layout) + adapter_parameters(layout)
    t = trainable_parameters(layout)  # p without adapters; else the frozen rest keeps its weights only
    w = WEIGHT_BYTES[layout.precision]
    dp, k, stage = layout.dp, layout.optimizer_states, layout.zero_stage
    grads = gradient_bytes(layout, t)
    if stage == 0:
        weights = float(w * p)
        master = 0.0 if layout.precision == "fp32" else 4.0 * t
        states = 4.0 * k * t
    else:
        weights = w * p / dp if stage == 3 else float(w * p)
        master = float(layout.master_bytes) * t / dp
        states = float(layout.state_bytes) * k * t / dp
    offloaded = 0.0
    if layout.offload_optimizer:
        offloaded, master, states = master + states, 0.0, 0.0
    buckets = 0.0
    if stage > 0 and layout.contiguous_gradients:
        buckets = layout.reduce_bucket_size * w * (2 if layout.overlap_comm else 1)
    return MemoryEstimate(parameters=p, weights=weights, gradients=grads, master_weights=master,
                          optimizer_states=states, offloaded=offloaded, zero_buckets=buckets,
                          activations=activation_bytes(layout))


def render(layout: MemoryLayout, est: MemoryEstimate, device_memory_gib: float | None,
           device_source: str | None = None) -> str:
    """The dry run's memory section."""
    zero = f"ZeRO-{layout.zero_stage}" + (" + optimizer offload" if layout.offload_optimizer else "")
    recompute = f", {layout.recomputed_layers} layer(s) recomputed" if layout.recomputed_layers else ""
    rows: list[tuple[str, float, str]] = [
        (f"weights ({layout.precision})", est.weights, ""),
        ("gradients", est.gradients, ""),
        (f"{_NAME[layout.master_bytes]} master weights", est.master_weights, ""),
        (f"optimizer states ({layout.optimizer_states} x {_NAME[layout.state_bytes]})", est.optimizer_states, ""),
    ]
    if est.zero_buckets:
        rows.append(("ZeRO gradient buckets", est.zero_buckets, "reduce_bucket_size, during the backward"))
    rows.append(("activations", est.activations, ""))
    rows.append(("total", est.total, "+ CUDA context and fragmentation"))
    if est.offloaded:
        rows.append(("in CPU memory (offload)", est.offloaded, "not on the device"))
    lines = [
        f"Memory estimate per device (tp={layout.tp} pp={layout.pp} dp={layout.dp}, {zero}, {layout.precision}, "
        f"micro batch {layout.micro_batch} x seq {layout.seq_length}{recompute}):",
        f"  {'parameters on the largest stage':<34}{est.parameters:>14,}",
    ]
    if layout.lora.lora_enabled:
        label = f"trained (LoRA r={layout.lora.lora_r})"
        lines.append(f"  {label:<34}{trainable_parameters(layout):>14,}  (the rest frozen: weights only)")
    for label, value, note in rows:
        lines.append(f"  {label:<34}{value / GiB:>10.2f} GiB" + (f"  ({note})" if note else ""))
    if device_memory_gib is not None:
        where = f" ({device_source})" if device_source else ""
        if est.total > device_memory_gib * GiB:
            lines.append(
                f"  WARNING: the estimate exceeds the device's {device_memory_gib:.1f} GiB{where}: use more "
                f"tensor/pipeline/data parallelism with ZeRO, activation checkpointing or a smaller micro batch"
            )
        else:
            lines.append(f"  fits in the device's {device_memory_gib:.1f} GiB{where}")
    return "\n".join(lines)


# --- the dry run -------------------------------------------------------------------------------------
ASSUMED_VOCAB = 50257
"""GPT-2's vocabulary, assumed (and padded for the run) when the tokenizer cannot be loaded."""


def _padded_vocab(run: EngineConfig) -> tuple[int, str]:
    """(padded vocabulary size, a note when it had to be assumed): the tokenizer's, padded as GPT-NeoX
    pads it for this run's tp (``make_vocab_size_divisible_by x tp``)."""
    if run.model.padded_vocab_size:
        return run.model.padded_vocab_size, ""
    tp = run.parallel.model_parallel_size
    try:
        return run.tokenizer.padded(build_tokenizer(run.tokenizer).vocab_size, tp), ""
    except Exception as err:  # an estimate must not fail the dry run; the launch reports a bad tokenizer
        return (run.tokenizer.padded(ASSUMED_VOCAB, tp),
                f"tokenizer vocabulary assumed {ASSUMED_VOCAB:,} (GPT-2's; tokenizer not loaded: {err})")


def local_device_memory_gib() -> float | None:
    """Memory of the first local GPU, when there is one (torch is not imported where no GPU driver is)."""
    if not devices.gpu_count():
        return None
    # lazy: torch only where a GPU driver is; the dry run's estimate runs without it
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GiB


# --- does it fit: refused before launch --------------------------------------------------------------
MEMINFO = "/proc/meminfo"
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""A container's memory limit (cgroup v2, v1): /proc/meminfo shows the whole host's, the limit is where the
kernel kills."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostMemory:
    """What the ranks of this machine share, in bytes."""

    total: float
    """The least of ``MemTotal`` and the cgroup's limit: what the ranks can ever have. The refusal compares
    with it, not with ``MemAvailable``: what is free changes from second to second (page cache, other
    jobs), so the same launch would be refused or not by chance; a run over it can never fit."""
    source: str
    available: float | None
    """``MemAvailable``: what is free now without swapping (a warning when the estimate exceeds it)."""


def host_memory(meminfo: str = MEMINFO, cgroup_limits: tuple[str, ...] = CGROUP_LIMITS) -> HostMemory | None:
    """This machine's memory (see :class:`HostMemory`); None where /proc/meminfo cannot be read."""
    fields: dict[str, float] = {}
    try:
        with open(meminfo) as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if value.split() and value.split()[0].isdigit():
                    fields[name] = float(value.split()[0]) * 1024  # kB
    except OSError:
        return None
    if "MemTotal" not in fields:
        return None
    total, source = fields["MemTotal"], "MemTotal in /proc/meminfo"
    for path in cgroup_limits:
        try:
            text = open(path).read().strip()  # noqa: SIM115 - one short read
        except OSError:
            continue
        if text.isdigit() and float(text) < total:
            total, source = float(text), f"this container's memory limit, {path}"
    return HostMemory(total=total, source=source, available=fields.get("MemAvailable"))


_KEY_OF_PART = {"activations": "train_micro_batch_size_per_gpu", "ZeRO gradient buckets": "zero_optimization",
                "model states": "zero_optimization"}
"""The key that most directly shrinks each part of the estimate (named in the refusal)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryFit:
    """The estimate of a launch and what the ranks of one node have: the dry run's section, and the
    refusal when it cannot fit (``allow_memory_overcommit`` turns the refusal into a warning)."""

    layout: MemoryLayout
    estimate: MemoryEstimate
    vocab_note: str = ""
    device_gib: float | None = None
    """One accelerator's memory (``device_memory_gb``, or this machine's GPU); None: not known here."""
    device_source: str | None = None
    ranks_here: int = 0
    """Ranks on this machine (0: they run elsewhere, whose host memory is not known here)."""
    cpu_ranks: bool = False
    """The ranks train on this machine's CPU: the estimate is host memory, shared by ``ranks_here``."""
    host: HostMemory | None = None

    @property
    def host_need(self) -> float:
        """Host memory one rank of this machine needs: everything on a CPU rank (a ZeRO bucket's pages
        only as far as the gradients fill it: Linux gives memory on the first write), else what
        offload_optimizer moves there."""
        est = self.estimate
        if not self.cpu_ranks:
            return est.offloaded
        buckets = 2 if self.layout.overlap_comm else 1
        filled = WEIGHT_BYTES[self.layout.precision] * trainable_parameters(self.layout) * buckets
        return est.model_states + est.offloaded + min(est.zero_buckets, filled) + est.activations

    def largest_part(self) -> str:
        est = self.estimate
        parts = {"activations": est.activations, "ZeRO gradient buckets": est.zero_buckets,
                 "model states": est.model_states + (est.offloaded if self.cpu_ranks else 0.0)}
        return max(parts, key=lambda part: parts[part])

    def problem(self) -> tuple[str, str] | None:
        """(why the launch cannot fit, the key of its largest part), or None when it fits or is not known."""
        est = self.estimate
        if self.device_gib is not None and est.total > self.device_gib * GiB:
            return (f"the memory estimate, {est.total / GiB:.2f} GiB per rank, exceeds the device's "
                    f"{self.device_gib:.1f} GiB ({self.device_source})", _KEY_OF_PART[self.largest_part()])
        if self.host is not None and self.ranks_here and self.ranks_here * self.host_need > self.host.total:
            what = "the ranks train on its CPU" if self.cpu_ranks else "offload_optimizer keeps states there"
            return (f"the memory estimate, {self.host_need / GiB:.2f} GiB per rank x {self.ranks_here} rank(s) "
                    f"on this machine = {self.ranks_here * self.host_need / GiB:.2f} GiB, exceeds its "
                    f"{self.host.total / GiB:.1f} GiB ({self.host.source}; {what})",
                    _KEY_OF_PART[self.largest_part()] if self.cpu_ranks else "zero_optimization")
        return None

    def warning(self) -> str | None:
        """The estimate fits the machine but not what is free on it now (MemAvailable)."""
        host = self.host
        if host is None or host.available is None or not self.ranks_here or self.problem() is not None:
            return None
        need = self.ranks_here * self.host_need
        if need <= host.available:
            return None
        return (f"the memory estimate of the {self.ranks_here} rank(s) on this machine, {need / GiB:.2f} GiB, is more "
                f"than is free on it now ({host.available / GiB:.1f} GiB MemAvailable of {host.total / GiB:.1f} GiB): "
                f"other processes hold the rest")

    def note(self) -> str:
        """One line beside a rank killed by SIGKILL: ``memory estimate 37.41 GiB per rank, ...``."""
        per_rank = self.host_need if self.cpu_ranks else self.estimate.total
        line = f"memory estimate {per_rank / GiB:.2f} GiB per rank"
        if self.cpu_ranks and self.host is not None and self.ranks_here:
            line += (f", {self.ranks_here} rank(s) on this machine: {self.ranks_here * per_rank / GiB:.2f} GiB of "
                     f"its {self.host.total / GiB:.1f} GiB ({self.host.source})")
        elif self.device_gib is not None:
            line += f" on a {self.device_gib:.1f} GiB device"
        return line

    def report(self) -> str:
        """The memory section of ``deepy.py --dry-run``."""
        text = render(self.layout, self.estimate, self.device_gib, self.device_source)
        if self.cpu_ranks and self.host is not None and self.ranks_here:
            need = self.ranks_here * self.host_need
            verdict = "WARNING: exceeds" if need > self.host.total else "fits in"
            text += (f"\n  {verdict} this machine's {self.host.total / GiB:.1f} GiB ({self.host.source}): "
                     f"{self.ranks_here} CPU rank(s) x {self.host_need / GiB:.2f} GiB = {need / GiB:.2f} GiB "
                     f"(untouched ZeRO bucket pages cost no memory on the CPU)")
        return model_size(self.layout) + "\n" + text + (f"\n  note: {self.vocab_note}" if self.vocab_note else "")


def memory_fit(run: EngineConfig, launches_locally: bool) -> MemoryFit:
    """The estimate of the resolved run against what it will have: ``device_memory_gb`` (any launch), this
    machine's GPU, or, without one, this machine's memory shared by its CPU ranks (local launches only:
    the nodes of other launches are not known here)."""
    vocab, note = _padded_vocab(run)
    world = run.parallel.world_size or 1
    layout = MemoryLayout.from_run(run, world, vocab)
    device, source = run.logging.device_memory_gb, "device_memory_gb"
    local_gpu = local_device_memory_gib() if launches_locally else None
    if device is None and local_gpu is not None:
        device, source = local_gpu, "this machine's GPU"
    cpu = launches_locally and local_gpu is None
    return MemoryFit(layout=layout, estimate=estimate(layout), vocab_note=note, device_gib=device,
                     device_source=source if device is not None else None, ranks_here=world if launches_locally else 0,
                     cpu_ranks=cpu, host=host_memory() if launches_locally else None)


def dry_run_report(run: EngineConfig, launches_locally: bool) -> str:
    """The memory section of ``deepy.py --dry-run`` for the resolved run."""
    return memory_fit(run, launches_locally).report()


def model_size(layout: MemoryLayout) -> str:
    """The whole model (every stage and tensor-parallel shard), with the vocabulary padded as GPT-NeoX
    pads it for this run's tp (``make_vocab_size_divisible_by x tp``); "without embeddings" leaves out the
    token and position tables and an untied output layer."""
    c = layout.model
    return (f"Model: {num_parameters(c):,} parameters ({num_parameters(c, include_embeddings=False):,} without "
            f"embeddings), the whole model over all stages and tensor-parallel shards, vocabulary padded to "
            f"{c.padded_vocab_size:,} for tp={layout.tp}")
