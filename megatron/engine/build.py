"""Model + optimizer + LR schedule wrapped in a DeepSpeed engine.

Parallelism wraps the model from outside:

* ``pipe_parallel_size == 0``: the plain :class:`GPTModel`; DeepSpeed's ``DeepSpeedEngine`` gets our
  ``megatron.mpu`` module as ``mpu`` (tensor-parallel group for norms and ZeRO partitioning).
* ``pipe_parallel_size >= 1``: the same layers as ``PipelineModule`` stages on our topology (so the
  pipeline grid and our tp/pp/dp groups agree); DeepSpeed's ``PipelineEngine``.

ZeRO stages and precision come from the DeepSpeed config that deepy.py split off; the optimizer and
the LR scheduler are ours and handed to ``deepspeed.initialize`` (DeepSpeed builds only OneBitAdam,
which needs its engine's communication backend).

Gradient clipping in fp32 without ZeRO goes through :func:`clip_grad_norm`, installed on the engine
instead of DeepSpeed's: DeepSpeed's version skips replicated parameters (norms) on every pipeline
stage but the first and does not record the norm, so pipeline runs would clip differently from
the single-rank run and no ``train/grad_norm`` could be logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import logger as ds_logger
from torch import nn

from megatron import mpu
from megatron.checkpointing.neox import install as install_neox_layout
from megatron.deepspeed_internals import (
    before_optimizer_step,
    quiet_step_line,
    reduced_gradients,
    replace_fp32_clipping,
    skip_frozen_tied_gradients,
    skip_gradient_allreduce,
)
from megatron.errors import ConfigError
from megatron.mpu.parallel_config import PARTITION_NAMES, ParallelRun, partition_method_problem
from megatron.logging.console import deepspeed_prints_quiet, is_verbose
from megatron.logging.log import get_logger
from megatron.model import GPTConfig, GPTModel, pipeline_layer_specs
from megatron.model.lora import LoRAAdapter, adapters_of, apply_lora
from megatron.model.lora_config import LoRAArgs
from megatron.model.soft_prompt import prepare_soft_prompt
from megatron.model.soft_prompt_settings import SoftPromptSettings
from megatron.model.block import Block
from megatron.model.mup import apply_base_shapes, mup_param_groups
from megatron.model.pipeline import BLOCK_PARTITION, CHECKPOINTABLE_LAYERS, model_parameter_name
from megatron.model.transformer_engine import apply_transformer_engine
from megatron.mpu import experts as expert_parallel
from megatron.mpu import hybrid_shard
from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel
from megatron.engine import hybrid_shard as hybrid_shard_engine
from megatron.engine.activation_config import ActivationCheckpointArgs
from megatron.engine.compile_checks import require_toolchain
from megatron.engine.lr_schedules import LRScheduler, SchedulePolicy
from megatron.engine.moe import MoETraining, build_moe_training, install_expert_parallel, keep_expert_shards
from megatron.objectives import LMObjective, Objective, ObjectiveArgs, Reference
from megatron.engine.bnb import stable_position_embeddings
from megatron.engine.optimizers import DEEPSPEED_BUILT, build_optimizer, deepspeed_optimizer_block, param_groups
from megatron.engine.levanter_sophia import HessianProbe
from megatron.engine.zero_attach import install_zero_pre_step
from megatron.engine.whole_parameters import attach_whole_parameters

if TYPE_CHECKING:
    from megatron.engine.engine_config import EngineConfig

# GPT-NeoX partition names -> DeepSpeed's PipelineModule partition_method (blocks of every family)
PARTITION_METHODS: dict[str, str] = {name: BLOCK_PARTITION if name.startswith("type:") else name
                                     for name in PARTITION_NAMES}


@dataclass
class Engine:
    """What the loop needs: the DeepSpeed engine and facts about how the model is wrapped."""

    engine: Any  # DeepSpeedEngine or PipelineEngine
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    config: GPTConfig
    is_pipe: bool
    ds_config: dict[str, Any]
    moe: MoETraining | None = None
    """Aux-loss scale and router metrics of an MoE model (None when dense)."""
    objective: Objective = field(default_factory=lambda: LMObjective(ObjectiveArgs()))
    """The ``train_impl``'s batch preparation and loss (also the pipeline's ``loss_fn``)."""
    reference: Reference = field(default_factory=Reference)
    """Where DPO/KTO reference log-probs come from; set once the engine exists."""
    adapters: list[LoRAAdapter] = field(default_factory=list)
    """This rank's LoRA adapters (empty without ``lora_r``): the only trainable weights besides a
    reward model's head."""
    after_forward_only: Callable[[], None] | None = None
    """Called after each forward that has no backward (evaluation): DeepSpeed's checkpointing frees its buffers in
    the backward, so GPT-NeoX resets them there (``forward_only_cleanup``); None: nothing to free."""
    before_update: Callable[[torch.Tensor], None] | None = None
    """Told each training step's loss (a 0-dim device tensor, the same on every rank) before the update is
    applied: the bad-step rule's input (``skip_gate.py``); None: nothing needs it."""
    hessian_probe: HessianProbe | None = None
    """Sophia-H's Hutchinson estimate of the Hessian diagonal, measured by the step when due; None: another optimizer."""

    @property
    def is_last_stage(self) -> bool:
        return not self.is_pipe or self.engine.is_last_stage()

    @property
    def is_first_stage(self) -> bool:
        return not self.is_pipe or self.engine.is_first_stage()


def partition_method(method: str) -> str:
    problem = partition_method_problem(method)  # before launch: parallel_config.pipe_partition_method_known
    if problem is not None:
        raise ConfigError(problem)
    return PARTITION_METHODS.get(method.lower(), method)  # a type:<regex> other than GPT-NeoX's goes as it is


# --- activation checkpointing and compilation ----------------------------------------------------
def configure_activation_checkpointing(cfg: ActivationCheckpointArgs, num_layers: int) -> None:
    """DeepSpeed's checkpointing needs our mpu for ``partition_activations`` (shards saved inputs
    over the tensor-parallel group) and for the tp-aware RNG it restores during recompute."""
    deepspeed.checkpointing.configure(mpu, **cfg.deepspeed_checkpointing_options(num_layers))


def forward_only_cleanup(cfg: ActivationCheckpointArgs) -> Callable[[], None] | None:
    """What runs after a forward without a backward: with DeepSpeed's checkpointing, ``deepspeed.checkpointing.reset``
    (its contiguous buffers, which the backward would free: GPT-NeoX ea7aefd8 megatron/training.py ``evaluate``,
    read with ``deepspeed_activation_checkpointing``); torch's checkpoint keeps no such state."""
    if cfg.deepspeed_activation_checkpointing and cfg.recomputes_activations:
        return deepspeed.checkpointing.reset
    return None


def transformer_layers(model: nn.Module) -> list[Block]:
    """The blocks (transformer, Mamba, RWKV, gMLP) of a GPTModel or of this rank's pipeline stage, in order."""
    return [m for m in model.modules() if isinstance(m, Block)]


def layers_to_checkpoint(cfg: ActivationCheckpointArgs, num_local_layers: int, first_index: int = 0) -> list[int]:
    """Local indices of the blocks whose activations are recomputed.

    ``selective_checkpointing = k``: only every k-th block (by global layer number), which saves
    recompute where memory allows; else all blocks when ``checkpoint_activations``.
    """
    k = cfg.selective_checkpointing
    if k:
        return [i for i in range(num_local_layers) if (first_index + i) % k == 0]
    if cfg.checkpoint_activations:
        return list(range(num_local_layers))
    return []


@contextlib.contextmanager
def _tracked_streams_restored(saved: dict[str, Any]) -> Iterator[None]:
    """While torch's checkpoint recomputes: the model-parallel RNG streams (``mpu/random.py``) as they were when the
    forward first ran, so the recomputed dropout masks are the same (torch restores only the default generators)."""
    tracker = mpu.get_rng_tracker()
    now = tracker.get_states()
    tracker.set_states(saved)
    try:
        yield
    finally:
        tracker.set_states(now)


def torch_checkpoint(function: Callable[..., Any], *inputs: Any) -> Any:
    """``function(*inputs)`` under torch's own checkpoint (``deepspeed_activation_checkpointing: false``): non-reentrant,
    the default generators and the tracked model-parallel streams restored for the recompute."""
    saved = mpu.get_rng_tracker().get_states()  # the tracker replaces a stream's state as it draws: a snapshot
    return torch.utils.checkpoint.checkpoint(
        function, *inputs, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (contextlib.nullcontext(), _tracked_streams_restored(saved)))


def checkpoint_function(cfg: ActivationCheckpointArgs) -> Callable[..., Any]:
    """The activation checkpoint the blocks recompute under: DeepSpeed's (``deepspeed_activation_checkpointing``,
    GPT-NeoX's default, which can partition over tp and offload to the CPU) or torch's."""
    return deepspeed.checkpointing.checkpoint if cfg.deepspeed_activation_checkpointing else torch_checkpoint


_RECOMPUTE = contextvars.ContextVar("recompute", default=True)
"""False inside :func:`recompute_suspended`."""


@contextlib.contextmanager
def recompute_suspended() -> Iterator[None]:
    """Checkpointed blocks run plainly (their activations kept): Sophia-H's Hessian-vector product differentiates
    the loss twice, which DeepSpeed's (reentrant) checkpoint cannot (``megatron/engine/levanter_sophia.py``)."""
    token = _RECOMPUTE.set(False)
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def _checkpointed(forward: Callable[..., torch.Tensor], checkpoint: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``forward`` under ``checkpoint``, which is handed the tensor arguments only: with DeepSpeed's
    ``partition_activations`` it pairs every argument with a size tensor and mis-counts
    ``None`` (an absent position_ids/attention_mask), so those stay in the closure."""

    def run(*inputs: Any) -> torch.Tensor:
        if not _RECOMPUTE.get():
            return forward(*inputs)
        where = [i for i, value in enumerate(inputs) if torch.is_tensor(value)]

        def with_tensors(*tensors: torch.Tensor) -> torch.Tensor:
            full = list(inputs)
            for i, tensor in zip(where, tensors):
                full[i] = tensor
            return forward(*full)

        return checkpoint(with_tensors, *(inputs[i] for i in where))

    return run


def _chunk_of(forwards: list[Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """Consecutive blocks run as one function: ``checkpoint_num_layers`` blocks share one checkpoint
    (only the chunk's input is kept; the whole chunk is recomputed in the backward pass)."""

    def run(x: torch.Tensor, *rest: Any) -> torch.Tensor:
        for forward in forwards:
            x = forward(x, *rest)  # [s, b, h]
        return x

    return run


def _passthrough(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    """A block whose work its chunk's first block already did."""
    return x


def wrap_layers(model: nn.Module, cfg: ActivationCheckpointArgs, compile_layers: bool,
                pipe_interval_used: bool) -> None:
    """Compile and/or checkpoint blocks in place (their ``forward`` is replaced per instance).

    Without a pipeline, ``checkpoint_num_layers = k`` checkpoints chunks of k consecutive blocks, as
    PipelineModule's ``activation_checkpoint_interval`` does on a pipeline: the chunk's first block
    runs the whole chunk under one checkpoint and the others pass their input through."""
    layers = transformer_layers(model)
    if compile_layers:
        require_toolchain(torch.cuda.is_available())  # inductor builds native code on this node
        for layer in layers:
            layer.forward = torch.compile(layer.forward)
    if pipe_interval_used:
        return  # PipelineModule checkpoints chunks of layers itself
    first = min((layer.layer_number for layer in layers), default=0)
    chosen = layers_to_checkpoint(cfg, len(layers), first)
    size = 1 if cfg.selective_checkpointing else cfg.checkpoint_num_layers
    starts = chosen if size == 1 else chosen[::size]
    for start in starts:
        members = layers[start:start + size]
        layers[start].forward = _checkpointed(_chunk_of([m.forward for m in members]), checkpoint_function(cfg))
        for member in members[1:]:
            member.forward = _passthrough
    if chosen:
        get_logger().info("activation checkpointing: recomputing layers %s in chunks of %d%s",
                          [layers[i].layer_number for i in chosen], size,
                          " (inputs partitioned over tp)" if cfg.partition_activations else "")


# --- gradient norm -------------------------------------------------------------------------------
def grad_norm_sq_local(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradients this rank owns, counting every full parameter exactly once.

    Tensor-parallel shards count on every tp rank (they are disjoint); replicated parameters only on
    tp rank 0; pipeline copies of tied weights (``ds_pipe_replicated``) only on their owner stage.
    """
    tp_rank = mpu.get_tensor_model_parallel_rank()
    grads = [
        p.grad.detach()
        for p in parameters
        if p.grad is not None
        and not getattr(p, "ds_pipe_replicated", False)
        and (is_model_parallel_parameter(p) or tp_rank == 0)
    ]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).double().pow(2)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm over the whole model (all tp shards, all pipeline stages); clips in place
    when ``max_norm > 0``. Gradients must already be averaged over data parallelism."""
    device = next((p.grad.device for p in parameters if p.grad is not None), torch.device("cpu"))
    # experts split over data-parallel ranks differ between the ranks of their expert-parallel group
    dense, experts = expert_parallel.split_expert_parallel(parameters)
    norm_sq = grad_norm_sq_local(dense).to(device)
    if experts:
        norm_sq = norm_sq + expert_parallel.sum_over_expert_parallel(grad_norm_sq_local(experts).to(device))
    for group, size in ((mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()),
                        (mpu.get_pipe_parallel_group(), mpu.get_pipe_parallel_world_size())):
        if size > 1:
            dist.all_reduce(norm_sq, group=group)
    norm = math.sqrt(float(norm_sq))
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
    return norm


def install_fp32_clipping(engine: Any) -> None:
    """Route DeepSpeed's fp32 (no ZeRO) clipping through :func:`clip_grad_norm` and record the norm."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    replace_fp32_clipping(engine, lambda: clip_grad_norm(params, float(engine.gradient_clipping())))


def install_partial_grad_sum(engine: Any) -> None:
    """Sum the gradients of the parameters tensor parallelism leaves partial (norms and row-parallel
    biases under sequence parallelism, qk-norms over split heads, ...: ``mpu/layers.py``) over the tp
    group once per optimizer step, all in one all-reduce: after DeepSpeed's data-parallel reduction (the
    two sums commute) and before its clipping and update, where Megatron-LM's ``finalize_model_grads``
    takes it. Not per micro-batch in the backward: ZeRO-2 and the bf16 optimizer take ``param.grad``
    away during the backward, so the one point every DeepSpeed optimizer shares is the step."""
    params = partial_over_tensor_parallel(engine.module)
    if params:
        before_optimizer_step(engine, lambda: sum_partial_grads_over_tensor_parallel(reduced_gradients(params)))


# --- building ------------------------------------------------------------------------------------
def optimizer_offloaded(ds_config: dict[str, Any]) -> bool:
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    return int(zero.get("stage", 0) or 0) > 0 and str(offload.get("device", "none")).lower() == "cpu"


@contextlib.contextmanager
def _deepspeed_info_logs(on: bool) -> Iterator[None]:
    """``dump_state``: DeepSpeed prints its engine state (rank 0, during ``initialize``) at info level,
    which ``deepspeed_log_level`` (warning by default) would hide; the user asked for it, so DeepSpeed's
    logger speaks at info for that call."""
    previous = ds_logger.level
    if on and ds_logger.getEffectiveLevel() > logging.INFO:
        ds_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        ds_logger.setLevel(previous)


def construction(ds_config: dict[str, Any] | None,
                 device: torch.device | None = None) -> contextlib.AbstractContextManager[Any]:
    """Where the model is built: under deepspeed.zero.Init when ``ds_config`` is given (each module's
    weights are partitioned over the ZeRO-3 ranks right after they are made, so the whole model never
    exists on one rank), else on ``device`` (None: torch's default, the CPU)."""
    if ds_config is None:
        return torch.device(device) if device is not None else contextlib.nullcontext()
    view = deepspeed_mpu()
    return deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=view,
                               data_parallel_group=view.get_data_parallel_group())


def training_device() -> torch.device:
    """The device this rank trains on (``cuda:<LOCAL_RANK>`` on a GPU node, where ``initialize`` set
    it; else the CPU), the one DeepSpeed's engine moves the model to."""
    return torch.device(deepspeed.accelerator.get_accelerator().current_device_name())  # patchable


def deepspeed_mpu() -> Any:
    """The ``mpu`` DeepSpeed gets: ours, or under hybrid sharding a view whose data-parallel group is
    the shard group (ZeRO-3 partitions over it; ``megatron/mpu/hybrid_shard.py``)."""
    return hybrid_shard.ShardGroupView() if hybrid_shard.is_hybrid() else mpu


def build_model(config: GPTConfig, parallel: ParallelRun, ckpt: ActivationCheckpointArgs,
                compile_layers: bool, objective: Objective,
                lora: LoRAArgs | None = None, zero_init: dict[str, Any] | None = None,
                device: torch.device | None = None, prompt_init_ids: Sequence[int] = ()) -> tuple[nn.Module, bool]:
    """(module, is_pipe); a pipeline's last stage computes ``objective.loss``. With ``lora`` enabled
    the weights are frozen and adapters attached before any wrapping (compile, checkpointing).
    ``zero_init``: the DeepSpeed config to partition the model with while it is built (ZeRO-3, no pipeline).
    ``device``: where the weights are created (the rank's GPU: the model never exists whole in host
    memory, 14 GB per rank for 7B in bf16), in the run's dtype; each weight's values are drawn on the
    CPU as before (``mpu/initialize_weights.py``), so they are the same bits wherever it is built.
    ``prompt_init_ids``: the tokens of ``soft_prompt_tuning``'s init string, whose embeddings the prompt starts from."""
    soft_prompt = SoftPromptSettings.of(config.soft_prompt_tuning) is not None
    if ckpt.recomputes_activations:
        configure_activation_checkpointing(ckpt, config.arch.layers)
    if not parallel.uses_pipeline_module:
        with construction(zero_init, device):
            model = GPTModel(config)
        if config.use_mup:
            apply_base_shapes(model, config)
        if soft_prompt:  # only the prompt trains
            prepare_soft_prompt(model, list(prompt_init_ids))
        apply_transformer_engine(model, config)  # the te_* keys: nothing without them
        if lora is not None and lora.lora_enabled:
            apply_lora(model, lora, config.seed)
        wrap_layers(model, ckpt, compile_layers, pipe_interval_used=False)
        return model, False

    # whole-chunk checkpointing by PipelineModule unless only every k-th block is recomputed
    interval = ckpt.checkpoint_num_layers if ckpt.checkpoint_activations and not ckpt.selective_checkpointing else 0
    # no_grad: PipelineModule's constructor broadcasts each tied weight (the embedding shared by the first and
    # the last stage) from its owning stage with dist.broadcast, an in-place op torch has no autograd kernel for;
    # with grad on, torch marks the weight and warns at every backward that reaches it ("c10d::broadcast_: an
    # autograd kernel was not registered ... silently incorrect behavior"). The copy is an initialization, not
    # part of any graph; the weights are made requiring grad as ever.
    with deepspeed_prints_quiet(), construction(None, device), torch.no_grad():  # and its stage=0 layers=5 dump
        model = PipelineModule(
            layers=pipeline_layer_specs(config),
            loss_fn=objective.loss,
            topology=mpu.get_topology(),
            partition_method=partition_method(parallel.pipe_partition_method),
            activation_checkpoint_interval=interval,
            activation_checkpoint_func=checkpoint_function(ckpt),
            checkpointable_layers=CHECKPOINTABLE_LAYERS,
        )
    if config.use_mup:
        apply_base_shapes(model, config, model_parameter_name)
    if soft_prompt:  # only the prompt trains
        prepare_soft_prompt(model, list(prompt_init_ids))
    apply_transformer_engine(model, config)
    if lora is not None and lora.lora_enabled:
        apply_lora(model, lora, config.seed)
        skip_frozen_tied_gradients(model)
    wrap_layers(model, ckpt, compile_layers, pipe_interval_used=interval > 0)
    return model, True


def build_engine(run: EngineConfig, config: GPTConfig, train_iters: int, objective: Objective | None = None,
                 prompt_init_ids: Sequence[int] = ()) -> Engine:
    """Model, optimizer, schedule and ``deepspeed.initialize`` for ``config`` (vocabulary already sized).

    ``objective`` (default: language modelling) decides the pipeline's loss and, for reward models,
    the scalar head. ``prompt_init_ids``: the tokens of the soft prompt's init string (``build_model``)."""
    objective = objective if objective is not None else LMObjective(ObjectiveArgs())
    if config.value_head != objective.value_head:
        config = config.replace(value_head=objective.value_head)
    # GPT-NeoX hands the model's loss function cross_entropy(_fp16=fp16_lm_cross_entropy) (gpt2_model.py:133)
    objective.fp16_cross_entropy = config.fp16_lm_cross_entropy
    ds_config = dict(run.deepspeed_config)
    if run.parallel.context_parallel_size > 1 and "train_batch_size" in ds_config:
        # DeepSpeed counts the context-parallel ranks as data-parallel ones (megatron/mpu/topology.py),
        # each seeing the micro-batch once: its batch is cp times the number of samples
        ds_config["train_batch_size"] = int(ds_config["train_batch_size"]) * run.parallel.context_parallel_size
    ds_config = hybrid_shard_engine.deepspeed_config(ds_config)  # unchanged without hybrid sharding
    model, is_pipe = build_model(config, run.parallel, run.activation_config, run.engine.keys.compile_layers,
                                 objective, run.lora, zero_init=ds_config if run.engine.keys.zero_init else None,
                                 device=training_device(), prompt_init_ids=prompt_init_ids)
    if run.optimizer_config.use_bnb_optimizer:  # GPT-NeoX: bitsandbytes' embedding for the position table
        stable_position_embeddings(model)
    spec = run.lr_config.spec(train_iters, run.optimizer_config.peak_lr)
    policy = run.lr_config.resume_policy
    if run.optimizer_config.optimizer_kind in DEEPSPEED_BUILT:
        # DeepSpeed builds it (it needs the engine's communication backend); our schedule wraps it
        ds_config["optimizer"] = deepspeed_optimizer_block(run.optimizer_config)
        optimizer: Any = None
        scheduler: Any = lambda opt: LRScheduler(optimizer=opt, spec=spec, policy=policy)  # noqa: E731
        params: Any = param_groups(model, run.optimizer_config.applied_weight_decay, run.optimizer_config.weight_decay_embeddings)
    else:
        regroup = None
        if config.use_mup:  # mup's MuAdam/MuSGD learning rates per width (megatron/model/mup.py)
            kind, peak = run.optimizer_config.optimizer_kind, run.optimizer_config.peak_lr
            regroup = lambda groups: mup_param_groups(groups, kind, peak)  # noqa: E731
        optimizer = build_optimizer(model, run.optimizer_config, offload=optimizer_offloaded(ds_config),
                                    regroup=regroup)
        scheduler = LRScheduler(optimizer=optimizer, spec=spec, policy=policy)
        params = None
    with keep_expert_shards(model), _deepspeed_info_logs(bool(ds_config.get("dump_state"))):
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params,
            lr_scheduler=scheduler,
            config=ds_config,
            mpu=None if is_pipe else deepspeed_mpu(),
            dist_init_required=False,
        )
    if is_pipe:  # DeepSpeed's step line every steps_per_print steps, with --verbose only (Deepy logs its own)
        quiet_step_line(quiet=not is_verbose(run.logging.deepspeed_log_level))
    attach_whole_parameters(ds_optimizer)  # no-op unless ZeRO steps an optimizer of whole parameters (SOAP)
    install_expert_parallel(engine)  # no-op unless experts are split over data-parallel ranks
    install_partial_grad_sum(engine)  # no-op unless replicated weights see part of the data per tp rank
    # no-op unless a ZeRO-stepped optimizer needs all groups at once (Muon, Scion); installed before hybrid
    # sharding's replica average, which wraps the same step from outside and so runs first
    install_zero_pre_step(engine)
    hybrid_shard_engine.install(engine)  # no-op unless ZeRO-3 partitions are replicated (hsdp)
    # checkpoints are written (and read) in GPT-NeoX's layout: its tools and users read them
    install_neox_layout(engine, config, mpu.get_tensor_model_parallel_world_size())
    fp32 = not (engine.fp16_enabled() or engine.bfloat16_enabled())
    if fp32 and not engine.zero_optimization():
        install_fp32_clipping(engine)
        if not is_pipe and mpu.get_data_parallel_world_size() == 1:
            skip_gradient_allreduce(engine)
    probe = None
    if run.optimizer_config.optimizer_kind == "sophia_h":  # before launch: optimizer_checks.sophia_h_layout
        probe = HessianProbe(engine.module, ds_optimizer, int(run.optimizer_config.optimizer_params["rng_seed"]),
                             suspend_recompute=recompute_suspended)
    return Engine(engine=engine, optimizer=ds_optimizer, lr_scheduler=ds_scheduler,
                  config=config, is_pipe=is_pipe, ds_config=ds_config,
                  moe=build_moe_training(model, config.arch.layers, config.moe_num_experts), objective=objective,
                  adapters=adapters_of(model), after_forward_only=forward_only_cleanup(run.activation_config),
                  hessian_probe=probe)
