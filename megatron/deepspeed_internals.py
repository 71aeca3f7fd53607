"""Every place Deepy reaches past DeepSpeed's public API, in one module.

DeepSpeed (pinned: 0.19.8) has no public hook for a few things the trainer needs. Each touch below
says why it is needed; ``tests/unit/test_deepspeed_internals.py`` checks that every attribute used
here still exists and behaves as assumed, so a DeepSpeed upgrade fails those tests first instead of
silently changing training. ``tests/unit/test_private_api_boundary.py`` keeps every other module off
DeepSpeed's private names and off writes into its engine (torch's are in ``torch_internals.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


def skip_shared_memory_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op at start-up.

    On CPU, DeepSpeed's comm backend compiles a C++ extension (``deepspeed_shm_comm``) the first
    time any rank starts on a machine. It only serves DeepSpeed's inference all-reduce, which
    training never calls, yet the compile costs minutes on a fresh machine, needs a compiler, fails
    under resource limits (a capped file size, a full disk), and every run leaves its buffers in
    /dev/shm (they filled 19 GB of RAM over a day of test runs here). Marking it incompatible in
    DeepSpeed's op-compatibility cache (``deepspeed.ops.__compatible_ops__``) makes DeepSpeed skip
    it; every collective we use goes through torch.distributed on gloo unchanged.
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # probed once, cached by DeepSpeed as a dict
    compatible["deepspeed_shm_comm"] = False



def use_current_collective_names() -> None:
    """Make DeepSpeed's torch comm backend gather and reduce-scatter flat tensors through torch's current names.

    DeepSpeed 0.19.8's ``TorchBackend`` picks ``torch.distributed.all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` once, when its backend object (``deepspeed.comm.comm.cdb``) is made, and every
    flat gather and reduce-scatter of DeepSpeed goes through them (a pipeline's activations split over
    tensor-parallel ranks, ZeRO's partitions). torch 2.13 deprecates both - each call prints a
    ``FutureWarning`` once per rank - and their bodies are one call of ``all_gather_single`` /
    ``reduce_scatter_single`` with the same arguments; the backend gets those. Idempotent; nothing before
    DeepSpeed's comm is set up.
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import torch.distributed as dist
    from deepspeed.comm import comm

    backend = comm.cdb
    if backend is None:
        return
    for attribute, deprecated, current in (
            ("all_gather_function", "all_gather_into_tensor", "all_gather_single"),
            ("reduce_scatter_function", "reduce_scatter_tensor", "reduce_scatter_single")):
        replacement = getattr(dist, current, None)
        if replacement is not None and getattr(backend, attribute, None) is getattr(dist, deprecated, None):
            setattr(backend, attribute, replacement)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def defer_muon_kernel_compiles() -> None:
    """Import DeepSpeed's Muon module with its ``torch.compile`` wraps deferred to their first call.

    DeepSpeed's ZeRO optimizers import ``deepspeed.runtime.zero.muon.muon_optimizer`` on every run
    (an ``isinstance`` check in ``is_zero_supported_optimizer`` and in the gradient reduction), and
    that module wraps three kernels in ``torch.compile`` at import. Creating those wrappers imports
    TorchInductor: about 2 s of a CPU's time on every rank of every ZeRO run, for an optimizer
    Deepy does not offer. DeepSpeed routes the wraps through ``deepspeed.runtime.compiler.compile``;
    swapping it for a deferring decorator during this one import keeps the kernels exactly as
    they were (compiled with the same ``torch.compile`` when first called) and the start-up short.
    """
    if MUON_MODULE in sys.modules:
        return
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.runtime import compiler

    real = compiler.compile

    def deferred() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            compiled: list[Callable[..., Any]] = []

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                if not compiled:
                    compiled.append(real()(fn))
                return compiled[0](*args, **kwargs)

            return call

        return wrap

    compiler.compile = deferred
    try:
        __import__(MUON_MODULE)
    finally:
        compiler.compile = real


@contextlib.contextmanager
def universal_loading(engine: Any, enabled: bool) -> Iterator[None]:
    """``engine.load_checkpoint`` reads a universal checkpoint while this is on.

    DeepSpeed decides between its per-rank and its universal loader from the engine's config flag
    ``load_universal_checkpoint``, fixed at ``deepspeed.initialize``; Deepy only knows whether a
    checkpoint needs converting when it looks at it, so the flag is set for the one load.
    """
    config = engine._config
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = enabled
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


def replace_fp32_clipping(engine: Any, clip: Callable[[], float]) -> None:
    """Make DeepSpeed's fp32 (no ZeRO) gradient clipping call ``clip`` and record its norm.

    DeepSpeed's own version skips replicated parameters (norms) on every pipeline stage but the
    first and does not record the norm, so pipeline runs would clip differently from a single rank
    and no grad norm could be logged. ``clip_fp32_gradients`` is the method DeepSpeed calls at the
    step boundary; ``_global_grad_norm`` is what ``engine.get_global_grad_norm()`` returns.
    """

    def run() -> None:
        engine._global_grad_norm = clip()

    engine.clip_fp32_gradients = run


def skip_gradient_allreduce(engine: Any) -> None:
    """With one data-parallel rank there is nothing to average, yet DeepSpeed would still flatten,
    "all-reduce" and copy back every gradient each step (~2% of a small CPU step)."""
    engine.enable_backward_allreduce = False


def skip_frozen_tied_gradients(module: Any) -> None:
    """A ``PipelineModule`` whose tied weights are frozen (LoRA): DeepSpeed's
    ``allreduce_tied_weight_gradients`` all-reduces ``weight.grad`` unconditionally, and a frozen
    weight has none. Tied weights that still train keep DeepSpeed's reduction."""
    original = module.allreduce_tied_weight_gradients

    def reduce_trainable() -> None:
        if any(weight.grad is not None for weight, _ in module.get_tied_weights_and_groups()):
            original()

    module.allreduce_tied_weight_gradients = reduce_trainable


@contextlib.contextmanager
def separate_pipeline_loss_total(engine: Any) -> Iterator[None]:
    """A ``PipelineEngine.eval_batch`` whose loss function returns per-row values (a reference
    model's log-probs): the engine adds every micro-batch's output into ``total_loss``, which
    ``train_batch`` leaves holding the last step's scalar loss, and a ``[n]`` output cannot be added
    to it. Start from none and put the training value back afterwards."""
    saved, engine.total_loss = engine.total_loss, None
    try:
        yield
    finally:
        engine.total_loss = saved


def loss_scale(engine: Any) -> float | None:
    """The current fp16 loss scale (DeepSpeed exposes it only on its optimizer wrappers)."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    scale = getattr(optimizer, "cur_scale", None)  # FP16_Optimizer and the ZeRO optimizers
    if scale is None:
        scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else None


@contextlib.contextmanager
def recorded_checkpoint_writes(engine: Any) -> Iterator[list[BaseException]]:
    """Record (instead of raise) a failed write inside ``engine.save_checkpoint``.

    Raising inside DeepSpeed's save would leave this rank out of its closing barrier while the
    other ranks wait in it forever; so the engine's ``checkpoint_engine`` (DeepSpeed's pluggable
    writer) has its ``save``/``makedirs`` wrapped for the duration of one save, and the caller
    decides with every rank what to do about a failure.
    """
    ckpt_engine = engine.checkpoint_engine
    original_save, original_makedirs = ckpt_engine.save, ckpt_engine.makedirs
    errors: list[BaseException] = []

    def save(state_dict: Any, path: str) -> None:
        if not errors:
            try:
                original_save(state_dict, path)
            except Exception as err:  # noqa: BLE001 - disk full, permissions, ...
                errors.append(err)

    def makedirs(path: str, exist_ok: bool = False) -> None:
        try:
            original_makedirs(path, exist_ok=exist_ok)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    ckpt_engine.save, ckpt_engine.makedirs = save, makedirs
    try:
        yield errors
    finally:
        ckpt_engine.save, ckpt_engine.makedirs = original_save, original_makedirs


class OtherCheckpointEngine(TypeError):
    """The engine writes through a checkpoint engine other than ``TorchCheckpointEngine`` (its class name)."""


@contextlib.contextmanager
def checkpoint_writes_to(engine: Any, write: Callable[[Any, str], None]) -> Iterator[bool]:
    """Route every file of one ``engine.save_checkpoint`` to ``write(state_dict, path)`` instead of the engine's
    checkpoint engine (a background save serializes them into memory: ``checkpointing/background_writes.py``).
    Yields the engine's zipfile serialization setting (``TorchCheckpointEngine``'s, which ``write`` must follow to
    write the same bytes); raises :class:`OtherCheckpointEngine` for another one (Nebula, DeepSpeed's decoupled ones)."""
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ckpt_engine = engine.checkpoint_engine
    if not isinstance(ckpt_engine, TorchCheckpointEngine):
        raise OtherCheckpointEngine(type(ckpt_engine).__name__)
    original = ckpt_engine.save
    ckpt_engine.save = write
    try:
        yield bool(getattr(ckpt_engine, "zipfile_serialization", False))
    finally:
        ckpt_engine.save = original


@contextlib.contextmanager
def activation_checkpointing_kept() -> Iterator[None]:
    """Undo, on leaving, what ``deepspeed.checkpointing.configure`` and the model-parallel seeding set in
    DeepSpeed 0.19.8's activation-checkpointing module (module globals: ``mpu``, ``mp_rank``, ``mp_group``,
    ``PARTITION_ACTIVATIONS``, ``num_layers``, ...; the RNG tracker's states): a rehearsal configures it as rank r
    of a fake world, and a process that goes on (a test worker, a tool) would otherwise recompute blocks with
    that rank's seeds and options."""
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.runtime.activation_checkpointing import checkpointing

    names = [name for name, value in vars(checkpointing).items()
             if not name.startswith("__") and not callable(value) and not isinstance(value, type(checkpointing))]
    saved = {name: getattr(checkpointing, name) for name in names}
    lists = {name: list(value) for name, value in saved.items() if isinstance(value, list)}
    tracker = checkpointing.get_cuda_rng_tracker()
    states = tracker.get_states()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(checkpointing, name, value)
            if name in lists:
                value[:] = lists[name]
        tracker.set_states(states)


def model_parallel_rng_tracker_name() -> str:
    """The name under which DeepSpeed's activation checkpointing replays the tensor-parallel RNG
    stream: our dropout must draw from the same tracker entry for recompute to be exact."""
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.runtime.activation_checkpointing import checkpointing

    return str(checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME)


def merge_universal_tp_slices(info: dict[str, Any], zero_dir: Any, slices_dir: Any, tp: int, name: str,
                              shapes: list[Any]) -> None:
    """Glue one parameter's tensor-parallel fragments into its universal-checkpoint files.

    ``ds_to_universal`` does this for ZeRO checkpoints after cutting their flat partitions into
    ``<slices_dir>/<name>/<tp rank>/<state>.<dp rank>`` fragments; ``checkpointing/reshard.py``
    writes the same fragments from a ZeRO-0 checkpoint (which has no partitions) and hands them to
    the same step, so the files (and the metadata DeepSpeed's loader cuts them by) are DeepSpeed's own.
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.merge_tp_slices(info, str(zero_dir), str(slices_dir), tp, (name, shapes))


def untie_optimizer_steps(engine: Any) -> None:
    """Give every optimizer state its own ``step`` tensor after a universal load.

    DeepSpeed 0.19.8's ZeRO-3 universal loader stores one and the same step tensor in the state of
    every parameter group; torch's Adam increments its step in place, so with two groups (decay and
    no decay) the shared counter advances twice per iteration and the bias correction drifts
    (the resumed loss curve leaves the uninterrupted one from the second step on).
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    seen: set[int] = set()
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def wrap_gradient_allreduce(engine: Any, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Route the engine's data-parallel gradient reduction through ``wrap(original)``.

    ``engine.allreduce_gradients`` is the one method both ``DeepSpeedEngine.backward`` and the
    ``PipelineEngine``'s reduce step call; DeepSpeed offers no hook around it, and its own expert
    support would need its MoE layer class (see ``engine/moe.py``).
    """
    engine.allreduce_gradients = wrap(engine.allreduce_gradients)


def collect_engine_timers(engine: Any, log: Callable[..., None]) -> Any:
    """The engine's timer group (``engine.timers``), its printing replaced by ``log``; returned.

    DeepSpeed prints and resets its ``SynchronizedWallClockTimer`` group once per micro-step; an
    instance attribute shadows the method for every holder of the group (the engine, the pipeline
    engine, ZeRO's optimizer), so the spans accumulate until the caller reads them.

    DeepSpeed 0.19.8's ``PipelineEngine`` also starts its backward timers itself and then runs the
    base engine's backward hooks, which start the same timers again and crash ("bwd_microstep timer
    has already been started"; a pipeline with ``wall_clock_breakdown``, configs/125M.yml, hit it):
    emptying the base engine's backward timer lists (``engine.engine_timers``) leaves the pipeline's
    own start/stop as the only one.
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    from deepspeed.runtime.pipe.engine import PipelineEngine

    group = engine.timers
    group.log = log
    if isinstance(engine, PipelineEngine):
        engine.engine_timers.backward_timers = []
        engine.engine_timers.backward_inner_timers = []
    return group


def restore_engine_counters(engine: Any, counters: dict[str, Any]) -> None:
    """Put a checkpoint's step counters (``global_steps``, ``global_samples``, ``skipped_steps``, as
    DeepSpeed writes them into its model-states file) back on ``engine``, keeping any it lacks.

    ``engine.load_checkpoint`` restores them itself; ``checkpointing/reshard.py`` loads a universal
    checkpoint into a ZeRO-0 engine without it and has no public setter to use.
    """
    engine.global_steps = counters.get("global_steps", engine.global_steps)
    engine.global_samples = counters.get("global_samples", engine.global_samples)
    engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)


def has_partitioned_optimizer_state(param: Any) -> bool:
    """Whether ``param``'s optimizer state lives on DeepSpeed's flat partitions (ZeRO-3 marks the
    parameter with ``ds_id``, ZeRO-1/2 and the bf16 optimizer link it with ``_hp_mapping``), so it is
    read through ``deepspeed.utils.safe_get_full_optimizer_state`` instead of ``optimizer.state``."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def relink_optimizer_state_views(optimizer: Any) -> bool:
    """Link every parameter's view of its optimizer state again; False when ``optimizer`` has none.

    ZeRO-1/2 and the bf16 optimizer keep the states on flat master partitions and link each
    parameter's view once (``_lazy_init_hp_params_optimizer_state``, guarded by
    ``_hp_optimizer_states_linked``), right after the first optimizer step of the *first* param
    group, when the other groups (e.g. no weight decay) have no state yet, so their views stay empty
    (DeepSpeed 0.19.8). Clearing the guard and linking again once every group has stepped fixes that.
    """
    if not hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        return False
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
    return True


@dataclasses.dataclass(frozen=True)
class ZeroMaster:
    """One flat fp32 partition a ZeRO optimizer hands its optimizer to step, and where the model's parameters lie.

    Stages 1/2 (``stage_1_and_2.py``, DeepSpeed 0.19.8): the group's parameters lie one after another, each
    aligned, in a flat buffer split into equal consecutive partitions; ``offsets`` are their starts in the
    whole buffer (``round_robin_bit16_offsets``) and ``flat`` is this rank's partition
    (``single_partition_of_fp32_groups``). Stage 3 (``stage3.py``): each parameter is split into equal
    consecutive pieces of ``pieces`` elements (``partition_numel()``, the last rank's padded), and ``flat``
    (``fp32_partitioned_groups_flat``) is this rank's pieces one after another, starting at ``offsets``."""

    flat: Any
    params: list[Any]
    shapes: list[tuple[int, ...]]
    numels: list[int]
    offsets: list[int]
    pieces: list[int]
    stage3: bool
    group: Any


def zero_masters(optimizer: Any) -> list[ZeroMaster]:
    """The flat partitions of DeepSpeed's ZeRO optimizer ``optimizer`` (empty for any other)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # stage 3
        masters = []
        for flat, params in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups):
            pieces = [int(p.partition_numel()) for p in params]
            offsets = [sum(pieces[:i]) for i in range(len(pieces))]
            masters.append(ZeroMaster(flat, list(params), [tuple(p.ds_shape) for p in params],
                                      [int(p.ds_numel) for p in params], offsets, pieces, True,
                                      optimizer.dp_process_group))
        return masters
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # stages 1 and 2
        return [ZeroMaster(flat, list(params), [tuple(p.shape) for p in params], [int(p.numel()) for p in params],
                           [int(o) for o in offsets], [], False, group)
                for flat, params, offsets, group in zip(
                    optimizer.single_partition_of_fp32_groups, optimizer.round_robin_bit16_groups,
                    optimizer.round_robin_bit16_offsets, optimizer.real_dp_process_group)]
    return []


def zero_pending_gradients(optimizer: Any) -> list[tuple[Any, Any]]:
    """This rank's part of each parameter's reduced gradient, unscaled, between the backward and the step of
    DeepSpeed's ZeRO optimizer ``optimizer`` (empty for any other): ``(model parameter, fp32 tensor)`` pairs.

    What DeepSpeed 0.19.8's own global norm reads there: stages 1/2 ``zip(params_in_partition[i],
    averaged_gradients[i])`` without the ``_zero_padding`` entries (``scaled_global_norm``, ``get_grad_norm_direct``,
    stage_1_and_2.py:2943-2960, 2677), stage 3 ``zip(fp16_groups[i], averaged_gradients[i])`` (``_get_norm_groups``,
    stage3.py:2573-2584; each its partition, padding included), both still times the loss scale. The step itself
    then hands its optimizer one group (stage 3: one sub-group) at a time, so a norm over several groups has to be
    taken here, before it (:func:`before_zero_step`)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        groups = optimizer.fp16_groups
    elif hasattr(optimizer, "single_partition_of_fp32_groups"):
        groups = optimizer.params_in_partition
    else:
        return []
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    pairs: list[tuple[Any, Any]] = []
    for index, params in enumerate(groups):
        grads = optimizer.averaged_gradients.get(index)
        if grads is None:
            continue
        real = [g for g in grads if not getattr(g, "_zero_padding", False)]
        pairs.extend((param, grad.float() / scale) for param, grad in zip(params, real))
    return pairs


def before_zero_step(optimizer: Any, run: Callable[[], None]) -> None:
    """Call ``run`` at each step of DeepSpeed's ZeRO optimizer ``optimizer``, before it: the gradients are reduced
    (:func:`zero_pending_gradients`) and nothing is stepped yet. Replaces the instance's ``step`` (the engine calls
    ``self.optimizer.step()``), as :func:`reduce_zero3_gradients_before_step` does."""
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        run()
        return original(*args, **kwargs)

    optimizer.step = step


@contextlib.contextmanager
def zero3_params_held(params: list[Any]) -> Iterator[None]:
    """ZeRO-3's partitioned ``params`` gathered whole and kept so through forwards and backwards inside (nothing
    for other parameters). DeepSpeed 0.19.8's coordinator releases a module's parameters after its forward and
    backward (``partitioned_param_coordinator.release_sub_module``) unless ``is_external_param``, which is set here
    for the duration (and restored), inside ``deepspeed.zero.GatheredParameters``."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    # lazy: DeepSpeed loads where used; the launcher imports this module without it
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        external = [(p.is_external_param, set(p.ds_active_sub_modules)) for p in partitioned]
        for p in partitioned:
            p.is_external_param = True
        try:
            yield
        finally:
            for p, (was, active) in zip(partitioned, external):
                p.is_external_param = was
                p.ds_active_sub_modules.clear()
                p.ds_active_sub_modules.update(active)


# --- a PipelineModule's layers -----------------------------------------------------------------------
def pipeline_local_start(module: Any) -> int:
    """Index (in the ``PipelineModule``'s list of layer specs) of this stage's first layer; 0 for a
    module that is not split into stages. DeepSpeed keeps it as ``_local_start`` only."""
    return int(getattr(module, "_local_start", 0))


def pipeline_grid(module: Any) -> Any:
    """The ``PipelineParallelGrid`` a ``PipelineModule`` was built with (``_grid``): its
    ``data_parallel_id`` and ``get_slice_parallel_rank()`` place this stage's layer files."""
    return module._grid


def synchronize_tied_weights(module: Any) -> None:
    """Copy each tied weight from its owning stage to the others (``_synchronize_tied_weights``), as
    ``PipelineModule.load_state_dir`` does after reading the layers; a replacement loader must too."""
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import torch

    with torch.no_grad():  # a broadcast into a weight with grad on marks it for autograd (see engine.build_model)
        module._synchronize_tied_weights()


def replace_pipeline_layer_io(module: Any, save: Callable[..., None], load: Callable[..., None]) -> None:
    """Make a ``PipelineModule`` write and read its per-layer checkpoint files with ``save`` and ``load``.

    ``PipelineEngine.save_checkpoint``/``load_checkpoint`` call ``module.save_state_dict(save_dir,
    checkpoint_engine, exclude_frozen_params=...)`` and ``module.load_state_dir(load_dir,
    checkpoint_engine, strict=...)``; they are the only place the layer files' names and contents are
    decided, and DeepSpeed has no option to change them (GPT-NeoX's layout numbers them differently).
    """
    module.save_state_dict = save
    module.load_state_dir = load


def convert_module_state_dicts(engine: Any, on_save: Callable[[Any], Any], on_load: Callable[[Any], Any]) -> None:
    """A plain (not pipeline) engine's module weights pass through ``on_save`` on their way into a
    checkpoint and through ``on_load`` (given the whole checkpoint dict) on their way back.

    ``engine.module_state_dict`` and ``engine.load_module_state_dict`` are what ``save_checkpoint``
    and ``load_checkpoint`` call for the weights; DeepSpeed has no hook to rename them.
    """
    save, load = engine.module_state_dict, engine.load_module_state_dict

    def module_state_dict(*args: Any, **kwargs: Any) -> Any:
        return on_save(save(*args, **kwargs))

    def load_module_state_dict(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        return load(on_load(checkpoint), *args, **kwargs)

    engine.module_state_dict = module_state_dict
    engine.load_module_state_dict = load_module_state_dict


def checkpoint_being_loaded(engine: Any) -> Callable[[], Any]:
    """A getter of the tag directory ``engine.load_checkpoint(load_dir, tag, ...)`` is reading
    (``load_dir/tag``), None outside a load: ``on_load`` of :func:`convert_module_state_dicts` is
    handed the checkpoint dict only, and a Deepy checkpoint's format is recorded beside it
    (``deepy_meta.json``). DeepSpeed keeps the path only for pipeline engines (``_curr_ckpt_path``)."""
    loading: list[str] = []
    load = engine.load_checkpoint

    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        loading.append(os.path.join(load_dir, str(tag)) if tag is not None else "")
        try:
            return load(load_dir, tag, *args, **kwargs)
        finally:
            loading.pop()

    engine.load_checkpoint = load_checkpoint
    return lambda: (loading[-1] or None) if loading else None


# --- hybrid sharding (megatron/engine/hybrid_shard.py) ---------------------------------------------
def reduce_zero3_gradients_before_step(optimizer: Any, reduce: Callable[[Any], None]) -> None:
    """Call ``reduce(buffer)`` on ZeRO-3's partitioned gradients right before each optimizer step.

    ``DeepSpeedZeroOptimizer_Stage3`` keeps this rank's gradient partition of every parameter in one
    flat buffer (``grad_partitions_flat_buffer``); after the last micro-batch's backward it holds the
    gradients averaged over the partition group, and ``step()`` reads it for the overflow check, the
    gradient norm, clipping and the update. Hybrid sharding averages that buffer over the replicas
    there: one all-reduce of ``1/shard`` of the model per step, the same values on every replica, so
    their norms, clipping and skipped steps agree. DeepSpeed has no hook between its reduce-scatter
    and its step.
    """
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        reduce(optimizer.grad_partitions_flat_buffer)
        return original(*args, **kwargs)

    optimizer.step = step


def skip_checkpoint_writes(engine: Any) -> None:
    """Make ``engine.save_checkpoint`` write no file on this rank (it still takes part in every
    collective). Hybrid sharding's replicas hold the same ZeRO partitions under the same file names
    (``zero_pp_rank_<shard rank>_...``): only replica 0 writes them. ``save_non_zero_checkpoint`` and
    ``save_zero_checkpoint`` are the flags DeepSpeed sets once per rank in ``_configure_checkpointing``."""
    engine.save_non_zero_checkpoint = False
    engine.save_zero_checkpoint = False


@contextlib.contextmanager
def without_optimizer_state(engine: Any) -> Iterator[None]:
    """``engine.save_checkpoint`` inside writes the module's weights and no optimizer or LR-scheduler state
    (``no_save_optim``): the ZeRO files (``*_optim_states.pt``: the partitioned fp32 masters and moments) are skipped
    with DeepSpeed's per-rank ``save_zero_checkpoint`` flag, and the ``optimizer`` and ``lr_scheduler`` entries that
    the engine's ``_common_checkpoint_state`` puts into the model-states file are emptied."""
    zero_flag = engine.save_zero_checkpoint
    own = "_common_checkpoint_state" in vars(engine)
    common = engine._common_checkpoint_state

    def weights_only_state(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state: dict[str, Any] = common(*args, **kwargs)
        state["optimizer"] = None
        state["lr_scheduler"] = None
        return state

    engine.save_zero_checkpoint = False
    engine._common_checkpoint_state = weights_only_state
    try:
        yield
    finally:
        engine.save_zero_checkpoint = zero_flag
        if own:
            engine._common_checkpoint_state = common
        else:
            del engine._common_checkpoint_state


STEP_LINE_START = "steps: "
"""How the pipeline engine's own progress line starts (``steps: 10 loss: 6.0265 iter time (s): ...``)."""


def quiet_step_line(quiet: bool = True) -> None:
    """Keep the pipeline engine's ``steps: 10 loss: 6.0265 iter time (s): ...`` line off the console.

    DeepSpeed's PipelineEngine ``print()``s it on rank 0 every ``steps_per_print`` steps, past its
    logger, so ``deepspeed_log_level`` cannot hide it (the plain engine's twin goes through the logger
    at INFO and is hidden by it). Its loss is the last step's where Deepy's line averages the logging
    window, so the two disagree on the same step; Deepy logs every ``log_interval`` itself. The engine
    keeps ``steps_per_print`` as configured: a ``print`` in the pipeline engine's module namespace
    (which shadows the builtin there) drops that one line, and with ``quiet`` False (deepy.py
    ``--verbose``) lets it through again."""
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import deepspeed.runtime.pipe.engine as pipe_engine

    def filtered_print(*args: Any, **kwargs: Any) -> None:
        if _State.quiet_steps and args and str(args[0]).startswith(STEP_LINE_START):
            return
        builtins.print(*args, **kwargs)

    _State.quiet_steps = quiet
    if getattr(pipe_engine, "print", None) is None or not getattr(pipe_engine.print, "deepy", False):
        filtered_print.deepy = True  # type: ignore[attr-defined]  # a mark on a function object
        pipe_engine.print = filtered_print


class _State:
    quiet_steps = True


def before_optimizer_step(engine: Any, run: Callable[[], None]) -> None:
    """Call ``run`` at every optimizer step, after DeepSpeed's data-parallel gradient reduction and
    before its clipping, gradient norm and update.

    ``_take_model_step`` is the method both ``DeepSpeedEngine.step`` and the ``PipelineEngine``'s
    optimizer step call at the accumulation boundary, whatever the optimizer (ZeRO 0-2, the bf16
    optimizer, fp16); DeepSpeed has no hook there, and ``allreduce_gradients`` is not one: ZeRO-2 and
    the bf16 optimizer have consumed ``param.grad`` by then, and a pipeline's bf16 reduction bypasses it.
    """
    step = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        run()
        return step(*args, **kwargs)

    engine._take_model_step = take_model_step


def reduced_gradients(params: Any) -> list[Any]:
    """Where each parameter's data-parallel-reduced gradient is between DeepSpeed's reduction and its
    step (see :func:`before_optimizer_step`), as writable tensors: the bf16 optimizer's fp32 buffer
    (``_hp_grad``, the whole gradient on every rank), else ``param.grad`` (no ZeRO: reduced in place),
    else this rank's fragment of ZeRO-1/2's flat gradient partition (``_hp_mapping``, the accessor
    DeepSpeed's own ``safe_set_full_grad`` writes through; parameters outside this rank's partition have
    none). Ranks with the same data-parallel rank and the same parameter shapes get the same layout."""
    out = []
    for param in params:
        hp_grad = getattr(param, "_hp_grad", None)
        if hp_grad is not None:
            out.append(hp_grad)
        elif param.grad is not None:
            out.append(param.grad)
        elif getattr(param, "_hp_mapping", None) is not None:
            out.append(param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group))
    return out


def gate_optimizer_update(engine: Any, allow: Callable[[], bool]) -> None:
    """Let the optimizer's own update run only when ``allow()`` says so, once DeepSpeed has reduced, measured
    and clipped the gradients.

    ``basic_optimizer`` is the torch optimizer every DeepSpeed wrapper (ZeRO-1/2, the bf16 and fp16 optimizers)
    ends its step with - the fp32 master partitions it leaves unchanged are copied back into the module
    unchanged - and the engine's own optimizer without one. A refused update is not an overflow: DeepSpeed
    still zeroes the gradients and steps the LR scheduler."""
    base = engine.basic_optimizer
    step = base.step

    @functools.wraps(step)  # keeps the marks torch's LR schedulers put on the step they wrap
    def gated(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs) if allow() else None

    base.step = gated


def pending_grad_norm(engine: Any) -> float | None:
    """The global gradient norm (before clipping, unscaled) DeepSpeed computed at this step, read during its
    optimizer step: the wrapper's ``_global_grad_norm`` (ZeRO-1/2, bf16, fp16 set it before the update), or
    the engine's (no wrapper: set by Deepy's fp32 clipping, :func:`replace_fp32_clipping`, when
    ``gradient_clipping > 0``). None: nothing computed it."""
    wrapper = engine.optimizer
    if wrapper is not engine.basic_optimizer and getattr(wrapper, "_global_grad_norm", None) is not None:
        return float(wrapper._global_grad_norm)
    if float(engine.gradient_clipping()) > 0 and getattr(engine, "_global_grad_norm", None) is not None:
        return float(engine._global_grad_norm)
    return None



# --- the fp32 master weights (megatron/training/model_averaging.py) -----------------------------------
def fp32_master_slices(optimizer: Any, params: list[Any]) -> list[tuple[Any, int, Any] | None]:
    """Where ``optimizer`` (the engine's) keeps this rank's fp32 master copy of each of ``params`` (a bf16/fp16
    module's trainable parameters): ``(view, start, group)``, ``view`` a 1-D fp32 tensor on the optimizer's own
    storage (its step updates it in place; a checkpoint load and ``refresh_fp32_params`` copy into it), holding
    elements ``start .. start + view.numel()`` of the flattened parameter; ``group``: the process group whose
    ranks' views make up the whole parameter, None when ``view`` is the whole of it. None for a parameter the
    optimizer keeps no fp32 copy of. DeepSpeed 0.19.8's optimizers:

    - ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, marked on each parameter as ``_z3_optimizer``): this rank's
      partition of the parameter padded to a multiple of its partition group (``ds_process_group``), the same
      elements as ``param.ds_tensor``, at ``grad_position[param id] = (sub-group, offset, numel)`` of
      ``fp32_partitioned_groups_flat`` (what ``safe_get_local_fp32_param`` narrows, without its stream sync and
      its copy to the device, which would make the average of CPU-offloaded masters a copy).
    - ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and the bf16 optimizer (``BF16_Optimizer``: a pipeline's bf16 at
      stage 0, and stage 1 with fp32 gradient accumulation): the fragment of the parameter inside this rank's
      flat fp32 partition, ``param._hp_mapping.hp_fragment`` at ``lp_fragment_address.start`` (DeepSpeed's
      ``get_full_hp_param`` puts it there and all-reduces over ``param._dp_group``); a parameter wholly in
      other ranks' partitions has ``_hp_mapping`` None: an empty view.
    - Without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``: fp16, and bf16 without a pipeline): the whole
      parameter on every rank, in ``fp32_groups_flat[group]`` at the parameter's offset in its group
      (``_unflatten_dense_tensors`` order), or ``fp32_groups[group][index]``.
    """
    # lazy: DeepSpeed and torch load where used; the launcher imports this module without them
    import torch
    import torch.distributed as dist

    def _or_world(group: Any) -> Any:
        return dist.group.WORLD if group is None else group  # DeepSpeed's None: the default group

    whole: dict[int, Any] = {}  # FP16_Optimizer / FP16_UnfusedOptimizer: id(param) -> its whole fp32 copy
    flats: Any = getattr(optimizer, "fp32_groups_flat", None)
    singles: Any = getattr(optimizer, "fp32_groups", None)
    if flats is not None or singles is not None:
        for group_index, group in enumerate(optimizer.fp16_groups):
            offset = 0
            for index, param in enumerate(group):
                whole[id(param)] = (flats[group_index].narrow(0, offset, param.numel()) if flats is not None
                                    else singles[group_index][index].view(-1))
                offset += param.numel()
    out: list[tuple[Any, int, Any] | None] = []
    for param in params:
        zero3 = getattr(param, "_z3_optimizer", None)
        if zero3 is not None and hasattr(param, "ds_tensor"):
            group_index, offset, numel = zero3.grad_position[zero3.get_param_id(param)]
            flat = zero3.fp32_partitioned_groups_flat[group_index]
            if flat.numel() == 0:
                raise RuntimeError("the fp32 master partitions of this parameter are swapped out to NVMe "
                                   "(zero_optimization.offload_optimizer.device nvme)")
            group = _or_world(getattr(param, "ds_process_group", zero3.dp_process_group))
            out.append((flat.narrow(0, offset, numel), dist.get_rank(group=group) * numel, group))
        elif hasattr(param, "_hp_mapping"):
            mapping, group = param._hp_mapping, _or_world(param._dp_group)
            if mapping is None:
                out.append((torch.empty(0, dtype=torch.float32, device=param.device), 0, group))
            else:
                out.append((mapping.hp_fragment, mapping.lp_fragment_address.start, group))
        elif id(param) in whole:
            out.append((whole[id(param)], 0, None))
        else:
            out.append(None)
    return out
