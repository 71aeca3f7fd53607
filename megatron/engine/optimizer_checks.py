"""Before-launch checks of the optimizer's keys: the peak and floor learning rates, the flat keys that
repeat the ``optimizer`` block (``lr``, ``weight_decay``, ``optimizer_type``) and what 1-bit Adam needs.
Registered with every other check (``megatron/config_rules.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.config_rules import RuleContext, block_enabled, describe, rule, zero_stage
from megatron.launcher.checks import runs_on_this_machine
from megatron.engine.lr_schedules import min_lr_problem
from megatron.engine.optimizer_block import OPTIMIZER_KINDS
from megatron.engine.optimizer_config import peak_lr_setting


@rule
def learning_rates_ordered(ctx: RuleContext) -> list[str]:
    lr, lr_key = peak_lr_setting(ctx.get("lr"), ctx.get("optimizer"))
    min_lr = ctx.get("min_lr")
    problems = []
    if lr is None:
        problems.append("no learning rate: set lr (or optimizer.params.lr)")
    if min_lr is not None and min_lr < 0:
        problems.append(f"{ctx.show('min_lr')} is negative: use 0 or more")
    if lr is not None and min_lr is not None:
        shown = ctx.show("lr") if lr_key == "lr" else f"optimizer.params.lr={lr} ({describe(ctx.source('optimizer'))})"
        ordered = min_lr_problem(lr, min_lr, shown, ctx.show("min_lr"))
        if ordered:
            problems.append(ordered)
    optimizer = ctx.get("optimizer")
    if ctx.get("lr") is not None and optimizer is not None:
        block_lr = optimizer.params.lr
        if block_lr is not None and float(block_lr) != float(ctx.get("lr")):
            problems.append(
                f"{ctx.show('lr')} and optimizer.params.lr={block_lr} "
                f"({describe(ctx.source('optimizer'))}) disagree: keep one of them"
            )
    return problems


@rule
def one_weight_decay(ctx: RuleContext) -> list[str]:
    optimizer = ctx.get("optimizer")
    block_wd = optimizer.params.weight_decay if optimizer is not None else None
    if block_wd is None or not ctx.given("weight_decay") or float(block_wd) == float(ctx.get("weight_decay")):
        return []
    return [
        f"{ctx.show('weight_decay')} and optimizer.params.weight_decay={block_wd} "
        f"({describe(ctx.source('optimizer'))}) disagree: they are one setting, keep one of them"
    ]


@rule
def optimizer_type_agrees(ctx: RuleContext) -> list[str]:
    """The flat ``optimizer_type`` and the block's ``type`` name one optimizer."""
    optimizer = ctx.get("optimizer")
    if optimizer is None or not ctx.given("optimizer_type"):
        return []
    if OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower()) == optimizer.kind:
        return []
    return [
        f"{ctx.show('optimizer_type')} but optimizer.type={optimizer.type!r} "
        f"({describe(ctx.source('optimizer'))}): keep one of them"
    ]


@rule
def onebit_adam_needs_its_backend(ctx: RuleContext) -> list[str]:
    """DeepSpeed's 1-bit Adam compresses gradients with NCCL or MPI collectives on GPUs."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else str(ctx.get("optimizer_type")).lower()
    if kind != "onebitadam":
        return []
    problems = []
    if runs_on_this_machine(ctx) and not ctx.device.cuda:
        problems.append(
            "optimizer.type=OneBitAdam needs GPUs: DeepSpeed's 1-bit Adam communicates through NCCL or MPI "
            "(gloo on CPU is not supported); use Adam here"
        )
    if zero_stage(ctx) > 0:
        problems.append("optimizer.type=OneBitAdam does not work with ZeRO (DeepSpeed's 1-bit Adam "
                        "communicates the full gradients itself); use zero stage 0")
    return problems


@rule
def mup_optimizer_is_adam_or_sgd(ctx: RuleContext) -> list[str]:
    """use_mup (megatron/model/mup_config.py): GPT-NeoX ea7aefd8's get_optimizer asserts ``not use_mup or
    optimizer_type in (adam, sgd)``, the optimizers mup has learning rates for (MuAdam, MuSGD)."""
    if not ctx.get("use_mup"):
        return []
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind in ("adam", "sgd"):
        return []
    shown = f"optimizer.type={optimizer.type!r}" if optimizer is not None else ctx.show("optimizer_type")
    return [f"{ctx.show('use_mup')} with {shown}: muP's learning rates exist for Adam and SGD only (mup's "
            "MuAdam/MuSGD; GPT-NeoX ea7aefd8 asserts the same); use Adam, AdamW or SGD"]


@rule
def sophia_h_layout(ctx: RuleContext) -> list[str]:
    """Sophia-H's Hessian-vector product (``megatron/engine/levanter_sophia.py``) differentiates the loss twice
    through the plain module (under tensor parallelism through ``mpu.mappings``' collectives, whose backward is
    differentiable again; under ZeRO-3 with every weight held whole for the probe), and its estimate reaches the
    optimizer through DeepSpeed's fragment mapping (ZeRO 1-3): what cannot run it is refused here, before launch."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind != "sophia_h":
        return []
    shown = f"optimizer.type={optimizer.type!r}" if optimizer is not None else ctx.show("optimizer_type")
    problems = []
    if int(ctx.get("pipe_parallel_size")) >= 1:
        problems.append(f"{shown} with {ctx.show('pipe_parallel_size')}: Sophia-H's Hessian-vector product needs the "
                        "whole model's loss on this rank, which a pipeline stage does not have; use "
                        "pipe_parallel_size: 0")
    if int(ctx.get("context_parallel_size")) > 1:
        problems.append(f"{shown} with {ctx.show('context_parallel_size')}: the context-parallel attention's "
                        "exchanges (ring/all-to-all) have hand-written backwards that are not differentiable again, "
                        "so the Hessian-vector product would be wrong; use 1")
    if int(ctx.get("moe_num_experts")) > 1:
        problems.append(f"{shown} with {ctx.show('moe_num_experts')}: the experts' load-balancing loss is not "
                        "part of the Hessian-vector product's loss; use a dense model")
    return problems


WHOLE_TENSOR_KINDS = {"muon": "Muon", "scion": "Scion", "mars": "MARS", "cautious": "Cautious",
                      "adam_mini": "Adam-mini"}
"""Levanter's optimizers that act on whole tensors (``megatron/engine/levanter_whole_tensor_optim.py``)."""
ZERO_GATHERED_KINDS = frozenset({"muon", "scion", "adam_mini"})
"""Those that run under ZeRO 1-3: each matrix gathered whole from the partitions (``whole_parameters.ZeroWhole``;
Adam-mini for its block means)."""
ZERO_PARTITION_KINDS = frozenset({"mars", "cautious"})
"""Those that run under ZeRO 1-3 on the partition itself, their sums (MARS's norm, Cautious's mask counts per stack)
added over the data-parallel ranks (``levanter_whole_tensor_optim.zero_pieces``)."""
INNER_CLIP_KINDS = frozenset({"muon", "scion", "mars", "adam_mini"})
"""Those that clip by a global norm inside the optimizer (``optimizer.params.inner_max_grad_norm``)."""


@rule
def whole_tensor_optimizer_layout(ctx: RuleContext) -> list[str]:
    """Muon and Scion orthogonalise whole matrices, MARS, Muon and Scion clip by a global norm inside the optimizer,
    Cautious averages its mask over a weight in every layer: each needs every whole tensor on the rank that steps
    it. Tensor parallelism is handled in the optimizer (split matrices gathered over the tp ranks, norms and counts
    summed); ZeRO hands the optimizer a shard of a flat buffer, pipeline stages and expert-parallel ranks part of the
    layers or experts; those are refused here, before launch."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind not in WHOLE_TENSOR_KINDS:
        return []
    shown = f"optimizer.type={optimizer.type!r}" if optimizer is not None else ctx.show("optimizer_type")
    what = {"muon": "orthogonalises whole weight matrices and clips its AdamW half by their global norm",
            "scion": "orthogonalises whole weight matrices and clips its signum half by their global norm",
            "mars": "clips its corrected gradients by their global norm inside the optimizer",
            "cautious": "averages its mask over each weight in every layer",
            "adam_mini": "averages the squared gradient over blocks of whole rows (a vocabulary row, a kv head's "
                         "query or key rows, an output row) and clips its AdamW half by their global norm"}[kind]
    problems = []
    if zero_stage(ctx) >= 1 and kind not in ZERO_GATHERED_KINDS | ZERO_PARTITION_KINDS:
        problems.append(f"{shown} with ZeRO stage {zero_stage(ctx)}: Levanter's {WHOLE_TENSOR_KINDS[kind]} {what}, "
                        "and ZeRO hands the optimizer a shard of a flat buffer; use ZeRO stage 0 (data parallelism "
                        "steps the whole model on every rank)")
    if zero_stage(ctx) >= 1 and kind == "mars" and ctx.get("use_mup"):
        problems.append(f"{shown} with ZeRO stage {zero_stage(ctx)} and {ctx.show('use_mup')}: Levanter's MARS "
                        f"{what}, so under ZeRO (which steps one parameter group at a time) it keeps every parameter "
                        "in one group, and muP's per-width learning rates need several; use ZeRO stage 0")
    if zero_stage(ctx) >= 1 and kind in ZERO_PARTITION_KINDS:
        zero = ctx.get("zero_optimization")
        offload = (zero.get("offload_optimizer") or {}) if isinstance(zero, Mapping) else {}
        if isinstance(offload, Mapping) and str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
            problems.append(f"{shown} with zero_optimization.offload_optimizer (device {offload.get('device')!r}): "
                            f"Levanter's {WHOLE_TENSOR_KINDS[kind]} {what}; Deepy adds those sums over ZeRO's "
                            "partitions in the device memory DeepSpeed 0.19.8 steps without offloading (tested so); "
                            "remove offload_optimizer")
        if zero_stage(ctx) == 1 and ctx.get("precision") == "bfloat16":
            problems.append(f"{shown} with ZeRO stage 1 and {ctx.show('precision')}: DeepSpeed 0.19.8 may step it in "
                            "its BF16_Optimizer (stage 1 with fp32 gradient accumulation), not tested with Levanter's "
                            f"{WHOLE_TENSOR_KINDS[kind]}; use ZeRO stage 2 or 3 (or fp32)")
    if zero_stage(ctx) >= 1 and kind in ZERO_GATHERED_KINDS:
        zero = ctx.get("zero_optimization")
        offload = (zero.get("offload_optimizer") or {}) if isinstance(zero, Mapping) else {}
        if isinstance(offload, Mapping) and str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
            problems.append(f"{shown} with zero_optimization.offload_optimizer (device {offload.get('device')!r}): "
                            f"Levanter's {WHOLE_TENSOR_KINDS[kind]} gathers each matrix from the ZeRO partitions "
                            "and takes its clip's norm from the reduced gradients, which DeepSpeed 0.19.8 keeps "
                            "elsewhere when it offloads the optimizer; remove offload_optimizer")
        if zero_stage(ctx) == 1 and ctx.get("precision") == "bfloat16":
            problems.append(f"{shown} with ZeRO stage 1 and {ctx.show('precision')}: DeepSpeed 0.19.8 may step it in "
                            "its BF16_Optimizer (stage 1 with fp32 gradient accumulation), whose flat buffers do not "
                            "say where each matrix lies; use ZeRO stage 2 or 3 (or fp32)")
    if int(ctx.get("pipe_parallel_size")) > 1:
        problems.append(f"{shown} with {ctx.show('pipe_parallel_size')}: Levanter's {WHOLE_TENSOR_KINDS[kind]} "
                        f"{what}, and a pipeline stage holds part of the layers; use 0 or 1")
    if int(ctx.get("pipe_parallel_size")) == 1 and ctx.get("precision") == "bfloat16":
        problems.append(f"{shown} with {ctx.show('pipe_parallel_size')} and {ctx.show('precision')}: Levanter's "
                        f"{WHOLE_TENSOR_KINDS[kind]} {what}, and DeepSpeed 0.19.8 wraps a pipeline module's bf16 "
                        "optimizer in its BF16_Optimizer, which hands it flat buffers; use pipe_parallel_size: 0 "
                        "(its mixed-precision wrapper keeps each weight whole) or fp32")
    if int(ctx.get("moe_expert_parallel_size")) > 1:
        problems.append(f"{shown} with {ctx.show('moe_expert_parallel_size')}: Levanter's "
                        f"{WHOLE_TENSOR_KINDS[kind]} {what}, and an expert-parallel rank holds part of the "
                        "experts; use 1")
    clip = float(ctx.get("gradient_clipping") or 0.0)
    if kind in INNER_CLIP_KINDS and clip > 0:
        problems.append(f"{shown} clips inside the optimizer as Levanter does (optimizer.params.inner_max_grad_norm, "
                        f"default 1.0) but {ctx.show('gradient_clipping')} would also clip every gradient before it; "
                        "set gradient_clipping: 0")
    return problems


KRON = {"kron": "Kron"}
"""Levanter's PSGD Kron (``megatron/engine/levanter_kron.py``): its factors act on each whole parameter, gathered
under tp and ZeRO as SOAP's (its layouts are checked by :func:`preconditioner_layout`)."""


@rule
def kron_layout(ctx: RuleContext) -> list[str]:
    """``gradient_clipping`` with ``normalize_grads``, which Levanter's chain does not clip (kron.py:121@9263f81e),
    is refused before launch. The layouts Kron cannot gather are :func:`preconditioner_layout`'s."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind not in KRON:
        return []
    shown = f"optimizer.type={optimizer.type!r}" if optimizer is not None else ctx.show("optimizer_type")
    problems = []
    params = optimizer.params if optimizer is not None else None
    if getattr(params, "normalize_grads", False) and float(ctx.get("gradient_clipping") or 0.0) > 0:
        problems.append(f"{shown} with optimizer.params.normalize_grads and {ctx.show('gradient_clipping')}: "
                        "Levanter's Kron does not clip by the global norm when it normalises; set "
                        "gradient_clipping: 0")
    return problems


PRECONDITIONED_KINDS = {"soap": "SOAP", "kron": "Kron"}
"""Levanter's optimizers that precondition each parameter as a whole (``megatron/engine/levanter_soap.py``,
``megatron/engine/levanter_kron.py``)."""


@rule
def preconditioner_layout(ctx: RuleContext) -> list[str]:
    """SOAP keeps preconditioners over the dimensions of each whole parameter: under tensor parallelism and ZeRO 1-3
    it gathers them (``megatron/engine/whole_parameters.py``: a split gradient over the tp ranks, a flat ZeRO
    partition over the data-parallel ranks, as DeepSpeed 0.19.8's ``stage_1_and_2.py``/``stage3.py`` lay them).
    What it cannot gather is refused here, before launch: part of the experts, the flat fp32 buffer DeepSpeed's
    bf16 optimizer keeps for a pipeline or under ZeRO-1 (``BF16_Optimizer``, which says nothing of where each
    parameter lies), and partitions offloaded to the CPU or NVMe."""
    optimizer = ctx.get("optimizer")
    kind = optimizer.kind if optimizer is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind not in PRECONDITIONED_KINDS:
        return []
    shown = f"optimizer.type={optimizer.type!r}" if optimizer is not None else ctx.show("optimizer_type")
    what = f"Levanter's {PRECONDITIONED_KINDS[kind]} preconditions each whole parameter"
    problems = []
    if int(ctx.get("moe_expert_parallel_size")) > 1:
        problems.append(f"{shown} with {ctx.show('moe_expert_parallel_size')}: {what}, and an expert-parallel rank "
                        "holds part of the experts; use 1")
    if int(ctx.get("pipe_parallel_size")) >= 1 and block_enabled(ctx.get("bf16")):
        problems.append(f"{shown} with bf16 and {ctx.show('pipe_parallel_size')}: {what}, and DeepSpeed's bf16 "
                        "optimizer of a pipeline steps one flat fp32 buffer; use pipe_parallel_size: 0 or fp32")
    if zero_stage(ctx) == 1 and ctx.get("precision") == "bfloat16":
        problems.append(f"{shown} with ZeRO stage 1 and {ctx.show('precision')}: {what}, and DeepSpeed 0.19.8 may "
                        "step it in its BF16_Optimizer (stage 1 with fp32 gradient accumulation), whose flat buffers "
                        "do not say where each parameter lies; use ZeRO stage 2 or 3 (or fp32)")
    zero = ctx.get("zero_optimization")
    offload = (zero.get("offload_optimizer") or {}) if isinstance(zero, Mapping) else {}
    if zero_stage(ctx) >= 1 and isinstance(offload, Mapping) and \
            str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
        problems.append(f"{shown} with zero_optimization.offload_optimizer (device {offload.get('device')!r}): "
                        f"{what}, gathered from ZeRO's partitions in the device memory DeepSpeed 0.19.8 steps "
                        "without offloading (the gather is not built for offloaded partitions); remove "
                        "offload_optimizer")
    return problems
