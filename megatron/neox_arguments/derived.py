"""Derived values (world size, batch sizes, precision, ...) and ``finalize``, the last check before launch.

``finalize(resolved, world_size)`` fills in every value the user may leave out, marks it
``derived`` in the provenance, runs every registered check (:mod:`megatron.neox_arguments.check_modules`)
and attaches the DeepSpeed config. All problems found on the way are raised together as one
:class:`~megatron.errors.ConfigError`.

Each derivation is a small function ``(ctx) -> Derivation`` in :data:`DERIVATIONS`; they run in
order and each sees the values derived before it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from megatron import devices
from megatron.checkpointing.resume_checks import batch_across_layouts
from megatron.data.batch import BatchError, BatchLayout, solve_batch
from megatron.data.batch_schedule import schedule_problems
from megatron.engine.optimizer_block import AdamParams
from megatron.errors import ConfigError
from megatron.launcher.checks import runs_on_this_machine
from megatron.launcher.config import DeepSpeedRunnerArgs
from megatron.launcher.resources import (
    active_resources as launcher_resources,
    uses_local_pool as launcher_uses_local_pool,
)
from megatron.logging.config import LoggingArgs, WandbSettings, WandbTrackerArgs
from megatron.logging.wandb_login import login_state
from megatron.model.mlp_width import legacy_llama_width
from megatron.neox_arguments.deepspeed_split import deepspeed_config, deepspeed_problems, extra_args_problems
from megatron.neox_arguments.hybrid_shard_rules import hybrid_shard_problems, shard_size
from megatron.objective_needs import needs_of
from megatron.neox_arguments.honesty import FILLED_IN_KEYS
from megatron.config_rules import DERIVED
from megatron.config_rules import Device, RuleContext, block_enabled, check, describe
from megatron.time_phrases import TimePhraseError, parse_duration

# every module that registers checks (config_rules.RULES), in report order
from megatron.neox_arguments import check_modules  # noqa: F401  isort: skip

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig


# --- world size ---------------------------------------------------------------------------------
def local_device_count() -> int:
    """Ranks a plain single-node launch gets: the CUDA device count, or one CPU rank."""
    return devices.gpu_count() or 1


def detect_world_size(args: NeoXArgs, device_count: int | None = None, warnings: list[str] | None = None) -> int:
    """How many ranks the launch will start for these arguments (see :mod:`megatron.launcher.resources`:
    the Slurm allocation, the hostfile or this machine's devices, filtered by include/exclude and
    counted by num_nodes/num_gpus as DeepSpeed's runner does). Without CUDA, ``num_gpus: N`` means N
    CPU ranks. Things worth saying (a hostfile that does not exist, ...) go to ``warnings``."""
    active = active_resources(args, device_count, warnings)
    world = sum(len(slots) for slots in active.values())
    if world < 1:
        raise ConfigError("no ranks left to launch after include/exclude: check include/exclude/hostfile")
    return world


def active_resources(args: NeoXArgs, device_count: int | None = None,
                     warnings: list[str] | None = None) -> dict[str, list[int]]:
    """host -> slot ids the ranks will use (see :mod:`megatron.launcher.resources`)."""
    devices = local_device_count if device_count is None else (lambda: device_count)
    return launcher_resources(args, os.environ, devices, warnings)


def uses_local_pool(args: DeepSpeedRunnerArgs) -> bool:
    """True when the ranks run on this machine only, sized by num_gpus or the device count."""
    return launcher_uses_local_pool(args, os.environ)


# --- derivations ------------------------------------------------------------------------------------
@dataclass
class Derivation:
    values: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    respelled: dict[str, Any] = field(default_factory=dict)
    """Values that say what the user wrote, in the spelling DeepSpeed reads: set, but keep their
    provenance (``file:line``), so rules and messages still treat them as the user's."""


Deriver = Callable[[RuleContext], Derivation]
DERIVATIONS: list[Deriver] = []


def deriver(fn: Deriver) -> Deriver:
    DERIVATIONS.append(fn)
    return fn


@deriver
def derive_layout(ctx: RuleContext) -> Derivation:
    """World size, and num_gpus for a local run so the runner starts exactly the ranks checked here."""
    values: dict[str, Any] = {
        "world_size": ctx.world_size,
        "global_num_gpus": ctx.world_size,
        "is_pipe_parallel": ctx.uses_pipeline_module,
    }
    problems = [
        f"{ctx.show(key)} but Deepy computes {value} for this launch: {key} is filled in by Deepy "
        f"({FILLED_IN_KEYS[key]}); remove it"
        for key, value in values.items()
        if ctx.given(key) and ctx.get(key) != value
    ]
    if problems:
        return Derivation(problems=problems)
    if ctx.get("num_gpus") is None and uses_local_pool(cast(DeepSpeedRunnerArgs, ctx.args)) and not ctx.device.cuda:
        # DeepSpeed's CPU accelerator counts NUMA nodes when num_gpus is absent; pin the count we
        # checked. Not with CUDA: an explicit --num_gpus makes the runner ignore CUDA_VISIBLE_DEVICES.
        values["num_gpus"] = ctx.world_size
    return Derivation(values)


MICRO_BATCH_ALIASES = ("train_micro_batch_size_per_gpu", "batch_size", "per_device_parallelism")


@deriver
def derive_batch(ctx: RuleContext) -> Derivation:
    """train_batch_size = micro batch x gradient accumulation x dp; any two give the third
    (:func:`megatron.data.batch.solve_batch`, the one place that computes and checks it). The layout's
    numbers are recorded in the resolved config, ``derived`` where the user left them out, so
    ``--dry-run`` shows them and the DeepSpeed split copies them."""
    dp = ctx.dp
    if dp is None:
        return Derivation()  # the layout rule reports the world size
    micro_keys = [key for key in MICRO_BATCH_ALIASES if ctx.get(key) is not None]
    if len({ctx.get(key) for key in micro_keys}) > 1:
        shown = ", ".join(ctx.show(key) for key in micro_keys)
        return Derivation(problems=[f"{shown} all name the per-rank micro batch but differ: keep one"])
    gas = ctx.get("gradient_accumulation_steps") if ctx.given("gradient_accumulation_steps") else None
    micro, micro_key = (ctx.get(micro_keys[0]), micro_keys[0]) if micro_keys else (None, "train_micro_batch_size_per_gpu")
    total = ctx.get("train_batch_size")
    steps = ctx.get("train_batch_size_schedule")
    if total is None and steps and isinstance(steps[0], dict) and isinstance(steps[0].get("global_batch"), int):
        total = steps[0]["global_batch"]  # train_batch_size is step 0's batch
    if total is None and ctx.trains:  # a resume at another data-parallel size keeps the checkpoint's global batch
        total, problems = batch_across_layouts(ctx, dp, micro, micro_key, gas)
        if problems:
            return Derivation(problems=problems)
    try:
        layout = solve_batch(micro, gas, total, dp, show=ctx.show, micro_key=micro_key)
    except BatchError as err:
        return Derivation(problems=[err.message])
    impl, least = ctx.get("train_impl"), needs_of(ctx.get("train_impl")).min_micro_batch
    if layout.micro < least:
        shown = ctx.show(micro_key) if micro is not None else f"{micro_key}={layout.micro} (derived)"
        return Derivation(layout.keys(), problems=[
            f"{shown} with train_impl: {impl}: its loss compares the samples inside a micro-batch, which needs at "
            f"least {least} samples; raise it to {least} or more"])
    if steps is not None:
        problems = schedule_rule_problems(ctx, steps, layout)
        if problems:
            return Derivation(layout.keys(), problems=problems)
    return Derivation(layout.keys())


def schedule_rule_problems(ctx: RuleContext, steps: Any, layout: BatchLayout) -> list[str]:
    """``train_batch_size_schedule`` against the solved layout: entries, multiples of micro x dp, and the
    engines and keys it cannot go with (a pipeline engine runs a fixed number of micro-batches)."""
    shown = ctx.show("train_batch_size_schedule")
    if not isinstance(steps, list):
        return [f"{shown}: give a list of {{start_step, global_batch}}"]
    given = ctx.get("train_batch_size") if ctx.given("train_batch_size") else None
    problems = [f"{shown}: {p}" for p in schedule_problems(steps, layout.micro, layout.dp, given)]
    if ctx.uses_pipeline_module:
        problems.append(f"{shown} with {ctx.show('pipe_parallel_size')}: DeepSpeed's pipeline engine runs a fixed "
                        "number of micro-batches per step; use pipe_parallel_size: 0 or one train_batch_size")
    for key in ("train_epochs", "max_train_epochs"):
        if ctx.get(key):
            problems.append(f"{shown} with {ctx.show(key)}: epochs are counted in steps of one batch size; "
                            "give train_iters")
    return problems


@deriver
def derive_positions(ctx: RuleContext) -> Derivation:
    if ctx.get("max_position_embeddings") is None and ctx.get("seq_length") is not None:
        return Derivation({"max_position_embeddings": ctx.get("seq_length")})
    return Derivation()


# mlp_type: llama computes w2(act(w1 x) * w3 x): the gated form of the configured activation
_GATED_FORM = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "relu": "reglu"}


@deriver
def derive_llama_mlp_type(ctx: RuleContext) -> Derivation:
    """``mlp_type: llama`` (GPT-NeoX's Llama/Mistral configs before ``swiglu`` existed) in the keys
    Deepy's model reads: the gated activation, no MLP biases, and LLaMA's MLP width (each half
    ``intermediate_size`` wide as given, ``megatron/model/mlp_width.py``)."""
    if ctx.get("mlp_type") != "llama":
        return Derivation()
    activation, hidden = ctx.get("activation"), ctx.get("hidden_size")
    problems = []
    if ctx.given("mlp_multiple_of") and ctx.get("mlp_multiple_of") != 1:
        problems.append(f"{ctx.show('mlp_type')} sizes each half of the MLP by intermediate_size alone (GPT-NeoX's "
                        f"rule before mlp_multiple_of existed), but {ctx.show('mlp_multiple_of')}: drop mlp_type "
                        f"to use GPT-NeoX's current width rule, or remove mlp_multiple_of")
    if activation not in _GATED_FORM:
        problems.append(
            f"{ctx.show('mlp_type')} gates {ctx.show('activation')}, which has no gated form here: use "
            f"activation {' / '.join(sorted(_GATED_FORM))}, or drop mlp_type and choose a *glu activation"
        )
    if ctx.given("use_bias_in_mlp") and ctx.get("use_bias_in_mlp"):
        problems.append(f"{ctx.show('mlp_type')} has no MLP biases, but {ctx.show('use_bias_in_mlp')}: remove one")
    if problems or hidden is None:
        return Derivation(problems=problems)  # a missing hidden_size is reported by its own rule
    values: dict[str, Any] = {"activation": _GATED_FORM[activation], "use_bias_in_mlp": False}
    if ctx.get("intermediate_size") is None:
        values["intermediate_size"] = legacy_llama_width(hidden, None)
    return Derivation(values)


_BLOCK_OF_PRECISION = {"fp16": "fp16", "bfloat16": "bf16"}

LOSS_SCALE_KEYS = ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "consecutive_hysteresis",
                   "min_loss_scale")
"""DeeperSpeed's (and DeepSpeed's) fp16 loss-scaling fields (``runtime/constants.py:157-181`` of DeeperSpeed at
91d1c55b, the commit GPT-NeoX pins)."""


@deriver
def derive_redundant_precision_flag(ctx: RuleContext) -> Derivation:
    """``fp16: {fp16: true, enabled: true, ...}`` (most of GPT-NeoX's own configs; ``bf16: {bf16: true}``
    likewise): DeeperSpeed reads only ``enabled`` and ignores the inner flag, while DeepSpeed's config
    parser refuses the unknown key. A flag that agrees with ``enabled`` is dropped with a warning; one
    that contradicts it is an error, since the config then says two things.

    A ``bf16`` block's loss-scale fields (GPT-NeoX's ``configs/rwkv/170M.yml`` copies its fp16 block's)
    mean nothing: DeeperSpeed reads only ``bf16.enabled`` (and ``immediate_grad_update``) from the block
    and fixes a bf16 run's loss scale at 1 (``runtime/config.py:167-171, 194-241`` at 91d1c55b); DeepSpeed
    0.19.8's ``DeepSpeedBF16Config`` refuses them. They are left out of DeepSpeed's config, and said."""
    out = Derivation()
    for name in ("fp16", "bf16"):
        block = ctx.get(name)
        if not isinstance(block, Mapping):
            continue
        kept = dict(block)
        if name in block:
            flag, enabled = block[name], bool(block.get("enabled", False))
            if isinstance(flag, bool) and flag and "enabled" not in block:
                out.problems.append(
                    f"{name}.{name}=True without {name}.enabled ({describe(ctx.source(name))}): DeeperSpeed, "
                    f"GPT-NeoX's DeepSpeed, reads only {name}.enabled (default false), so GPT-NeoX trains this "
                    f"config in fp32; set {name}.enabled: true for {name}, or remove the {name} block for fp32")
                continue
            if not isinstance(flag, bool) or flag != enabled:
                out.problems.append(
                    f"{name}.{name}={flag!r} and {name}.enabled={block.get('enabled')!r} "
                    f"({describe(ctx.source(name))}) disagree; DeepSpeed reads only {name}.enabled: "
                    f"remove {name}.{name}"
                )
                continue
            ctx.warnings.append(f"{name}.{name} ({describe(ctx.source(name))}) changes nothing ({name}.enabled "
                                f"decides, as in DeeperSpeed); left out of DeepSpeed's config")
            del kept[name]
        scaling = [key for key in LOSS_SCALE_KEYS if key in kept] if name == "bf16" else []
        if scaling:
            _say_no_loss_scaling(ctx, name, scaling)
            kept = {key: value for key, value in kept.items() if key not in scaling}
        if kept != dict(block):
            out.respelled[name] = kept
    return out


def _say_no_loss_scaling(ctx: RuleContext, block: str, keys: list[str]) -> None:
    ctx.warnings.append(
        f"{', '.join(f'{block}.{key}' for key in keys)} ({describe(ctx.source(block))}) have no effect: bf16 has no "
        f"loss scaling (DeeperSpeed, GPT-NeoX's DeepSpeed, keeps a bf16 run's loss scale at 1); left out of "
        f"DeepSpeed's config, which refuses them in a bf16 block")


@deriver
def derive_deeperspeed_bf16(ctx: RuleContext) -> Derivation:
    """``fp16: {enabled: true, type: bfloat16}`` is DeeperSpeed's (GPT-NeoX's fork) spelling of bf16,
    used by GPT-NeoX's own configs (Pythia-1B): it becomes DeepSpeed's ``bf16`` block."""
    fp16 = ctx.get("fp16")
    if not isinstance(fp16, Mapping) or str(fp16.get("type", "")).lower() not in ("bfloat16", "bf16"):
        return Derivation()
    if block_enabled(ctx.get("bf16")):
        return Derivation(problems=[
            f"fp16.type=bfloat16 ({ctx.source('fp16')}) and a bf16 block are both given: keep the bf16 block"
        ])
    enabled = bool(fp16.get("enabled", False))
    scaling = [key for key in LOSS_SCALE_KEYS if key in fp16]
    if enabled and scaling:  # Pythia-1B's; DeeperSpeed gave this type a scale of 1 (config.py:104-113@996951ef)
        _say_no_loss_scaling(ctx, "fp16", scaling)
    return Derivation({"fp16": None, "bf16": {"enabled": enabled}} if enabled else {"fp16": None})


@deriver
def derive_precision(ctx: RuleContext) -> Derivation:
    """precision from the fp16/bf16 blocks, or the block from ``precision`` when only it is given."""
    fp16, bf16 = block_enabled(ctx.get("fp16")), block_enabled(ctx.get("bf16"))
    if fp16 or bf16:
        if ctx.given("precision"):
            return Derivation()  # precision_matches_blocks compares them
        return Derivation({"precision": "fp16" if fp16 else "bfloat16"})
    precision = ctx.get("precision")
    if precision in _BLOCK_OF_PRECISION:
        block_key = _BLOCK_OF_PRECISION[precision]
        block = dict(ctx.get(block_key) or {})
        block["enabled"] = True
        return Derivation({block_key: block})
    return Derivation({"precision": "fp32"} if precision is None else {})


SHARDING_STAGES = {"fsdp": 3, "hsdp": 3, "ddp": 0}
"""ZeRO stage of each sharding_strategy."""


@deriver
def derive_sharding(ctx: RuleContext) -> Derivation:
    """``sharding_strategy`` -> the ``zero_optimization`` block it means (a stage or hpZ size the
    block gives otherwise is a contradiction); for hsdp also the shard size (hybrid_shard_problems)."""
    strategy = ctx.get("sharding_strategy")
    if strategy != "hsdp" and ctx.given("sharding_group_size"):
        return Derivation(problems=[f"{ctx.show('sharding_group_size')} is read only with sharding_strategy: "
                                    f"hsdp ({ctx.show('sharding_strategy')}); remove it or use hsdp"])
    if strategy is None:
        return Derivation()
    merged = dict(ctx.get("zero_optimization") or {})
    wanted: dict[str, Any] = {"stage": SHARDING_STAGES[strategy]}
    if strategy != "hsdp" and int(merged.get("zero_hpz_partition_size") or 1) > 1:
        wanted["zero_hpz_partition_size"] = 1
    problems = [
        f"{ctx.show('sharding_strategy')} means zero_optimization.{key}={value}, but zero_optimization."
        f"{key}={merged[key]} ({ctx.source('zero_optimization')}); keep one of them"
        for key, value in wanted.items() if key in merged and merged[key] != value
    ]
    if ctx.get("zero_stage") not in (None, wanted["stage"]):
        problems.append(f"{ctx.show('sharding_strategy')} contradicts {ctx.show('zero_stage')}; keep one of them")
    values: dict[str, Any] = {}
    if strategy == "hsdp":
        one_node = uses_local_pool(cast(DeepSpeedRunnerArgs, ctx.args))  # without num_gpus: this machine is one node
        problems += hybrid_shard_problems(ctx, merged, one_node)
        values["sharding_group_size"] = shard_size(ctx, one_node)
    if problems:
        return Derivation(problems=problems)
    return Derivation({"zero_optimization": {**merged, **wanted}, **values})


@deriver
def check_zero_init(ctx: RuleContext) -> Derivation:
    """``zero_init`` partitions the model as ZeRO-3 does, so it needs stage 3 and no pipeline."""
    if not ctx.get("zero_init"):
        return Derivation()
    stage = (ctx.get("zero_optimization") or {}).get("stage", ctx.get("zero_stage"))
    if ctx.get("sharding_strategy") in ("fsdp", "hsdp"):
        stage = 3
    problems = []
    if stage != 3:
        problems.append(f"{ctx.show('zero_init')} builds the model partitioned as ZeRO-3 does: set "
                        f"zero_optimization.stage 3 (or sharding_strategy fsdp/hsdp)")
    if ctx.uses_pipeline_module:
        problems.append(f"{ctx.show('zero_init')} does not go with a pipeline (pipe_parallel_size)")
    return Derivation(problems=problems)


@deriver
def derive_zero(ctx: RuleContext) -> Derivation:
    """``zero_stage`` (GPT-NeoX shorthand) and the ``zero_optimization`` block become one block."""
    block = ctx.get("zero_optimization")
    stage = ctx.get("zero_stage")
    shorthand = {
        "reduce_scatter": ctx.get("zero_reduce_scatter"),
        "contiguous_gradients": ctx.get("zero_contiguous_gradients"),
        "reduce_bucket_size": ctx.get("zero_reduce_bucket_size"),
        "allgather_bucket_size": ctx.get("zero_allgather_bucket_size"),
    }
    if isinstance(stage, int) and not isinstance(stage, bool):
        shorthand["stage"] = stage
    shorthand = {key: value for key, value in shorthand.items() if value is not None}
    if not shorthand:
        return Derivation()
    merged = dict(block or {})
    problems = []
    for key, value in shorthand.items():
        if key in merged and merged[key] != value:
            name = "zero_stage" if key == "stage" else f"zero_{key}"
            problems.append(
                f"{ctx.show(name)} contradicts zero_optimization.{key}={merged[key]} "
                f"({ctx.source('zero_optimization')}): keep one of them"
            )
        merged[key] = value
    if problems:
        return Derivation(problems=problems)
    return Derivation({"zero_optimization": merged})


@deriver
def derive_apex_max_grad_norm(ctx: RuleContext) -> Derivation:
    """``optimizer.params.max_grad_norm`` (apex FusedAdam's in-optimizer clipping, in GPT-NeoX's
    configuration guide) is the gradient clipping DeepSpeed does: it becomes ``gradient_clipping``."""
    block = ctx.get("optimizer")
    norm = block.params.max_grad_norm if block is not None and isinstance(block.params, AdamParams) else None
    if norm is None:
        return Derivation()
    disagree = [ctx.show(key) for key in ("gradient_clipping", "clip_grad") if ctx.given(key) and ctx.get(key) != norm]
    if disagree:
        return Derivation(problems=[
            f"optimizer.params.max_grad_norm={norm} ({describe(ctx.source('optimizer'))}) and "
            f"{' and '.join(disagree)} disagree: they are one setting (the global gradient-norm clip), keep one"
        ])
    return Derivation({"gradient_clipping": norm, "clip_grad": norm})


@deriver
def derive_clipping(ctx: RuleContext) -> Derivation:
    """``clip_grad`` (Megatron) and ``gradient_clipping`` (DeepSpeed) are one setting."""
    clip_given, ds_given = ctx.given("clip_grad"), ctx.given("gradient_clipping")
    clip, ds = ctx.get("clip_grad"), ctx.get("gradient_clipping")
    if clip_given and ds_given and clip != ds:
        return Derivation(problems=[
            f"{ctx.show('clip_grad')} and {ctx.show('gradient_clipping')} disagree: they are one "
            f"setting, keep one of them"
        ])
    if clip_given and not ds_given:
        return Derivation({"gradient_clipping": clip})
    if ds_given and not clip_given:
        return Derivation({"clip_grad": ds})
    return Derivation()


# Megatron's top-level fp16 loss-scaling keys -> their names in DeepSpeed's fp16 block
LOSS_SCALING_KEYS = {
    "loss_scale": "loss_scale",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_scale": "min_loss_scale",
}


@deriver
def derive_loss_scaling(ctx: RuleContext) -> Derivation:
    """Megatron's top-level loss-scaling keys go into DeepSpeed's fp16 block, which does the scaling.

    They act only with fp16 (bf16 and fp32 need no loss scaling), so setting one otherwise is an
    error rather than a silent no-op; a value that contradicts the fp16 block is one too.
    """
    given = [key for key in (*LOSS_SCALING_KEYS, "dynamic_loss_scale") if ctx.given(key)]
    if not given:
        return Derivation()
    if not block_enabled(ctx.get("fp16")):
        shown = ", ".join(ctx.show(key) for key in given)
        return Derivation(problems=[
            f"{shown}: fp16 loss scaling applies only when training in fp16 (precision: fp16), which this "
            f"run does not; remove them"
        ])
    block = dict(ctx.get("fp16"))
    problems = []
    wanted: dict[str, Any] = {LOSS_SCALING_KEYS[k]: ctx.get(k) for k in given if k in LOSS_SCALING_KEYS}
    if "dynamic_loss_scale" in given:
        if ctx.get("dynamic_loss_scale"):
            wanted.setdefault("loss_scale", 0)  # DeepSpeed: 0 = dynamic
            if wanted["loss_scale"] not in (0, None):
                problems.append(f"{ctx.show('dynamic_loss_scale')} contradicts {ctx.show('loss_scale')}")
        elif wanted.get("loss_scale") in (None, 0) and not block.get("loss_scale"):
            problems.append(f"{ctx.show('dynamic_loss_scale')} needs a fixed loss_scale (> 0)")
    for name, value in wanted.items():
        if name in block and block[name] != value:
            problems.append(
                f"fp16.{name}={block[name]} ({ctx.source('fp16')}) contradicts the top-level key setting "
                f"{value} ({', '.join(ctx.show(k) for k in given)}): keep one of them"
            )
        block[name] = value
    if problems:
        return Derivation(problems=problems)
    return Derivation({"fp16": block})


@deriver
def derive_git_hash(ctx: RuleContext) -> Derivation:
    """The commit of the code that runs, recorded with the run (GPT-NeoX computes it too)."""
    if ctx.get("git_hash"):
        return Derivation()

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return Derivation()
    commit = out.stdout.strip()
    return Derivation({"git_hash": commit}) if out.returncode == 0 and commit else Derivation()


@deriver
def derive_wandb_code_dir(ctx: RuleContext) -> Derivation:
    """``wandb_code_dir`` as an absolute path (of the launching directory), so every rank saves the same
    directory; it keeps its provenance (the user's file:line)."""
    value = ctx.get("wandb_code_dir")
    if not isinstance(value, str) or os.path.isabs(value):
        return Derivation()
    return Derivation(respelled={"wandb_code_dir": os.path.abspath(value)})


_NO_KEY = ("no W&B API key on this machine (WANDB_API_KEY, the ~/.netrc entry `wandb login` writes, wandb's "
           "settings), and the ranks have no terminal to ask for one: wandb.init would stop them (\"No API key "
           "configured\")")
_GO_ONLINE = "for online, run `wandb login` (or export WANDB_API_KEY) before launching"


@deriver
def derive_wandb_offline_without_a_key(ctx: RuleContext) -> Derivation:
    """A W&B run asked for without a login where the ranks run (Levanter's default tracker is W&B): wandb decides
    with no terminal by failing on the ranks after launch (``megatron/logging/wandb_login.py``). A mode left to
    W&B (Levanter's default, ``use_wandb``, a tracker without ``mode``) becomes ``offline``, said before launch:
    every row is kept for ``wandb sync``, and GPT-NeoX's own ``local_setup.yml`` (``use_wandb: true``) runs, as
    GPT-NeoX runs it without a key (it skips W&B: ``megatron/utils.py:144-183`` at ea7aefd8). ``mode: online``
    said explicitly is refused (docs/dialects.md says why)."""
    if not ctx.trains:
        return Derivation()
    try:
        wandb = next((t for t in ctx.group(LoggingArgs).tracker_settings() if isinstance(t, WandbSettings)), None)
    except ConfigError:
        return Derivation()  # the tracker check names the clash
    if wandb is None:
        return Derivation()
    try:
        # lazy: wandb is optional, imported only to check a W&B tracker
        import wandb as _  # noqa: F401 - the tracker check refuses a W&B that does not import
    except ImportError:
        return Derivation()
    login = login_state(wandb.host, wandb.mode)
    if login.state in ("no_login_needed", "logged_in"):
        return Derivation()
    asked = ctx.show("use_wandb") if wandb.source == "use_wandb" else f"W&B ({describe(ctx.source('tracker'))})"
    if not runs_on_this_machine(ctx) or login.state == "unknown":
        ctx.skipped.append(f"the W&B login of the ranks' machines ({asked}): "
                           f"{login.detail or 'the ranks run on other machines'}")
        return Derivation()
    if login.state == "bad_key":
        return Derivation(problems=[f"{asked}: wandb refuses this machine's key ({login.detail}); {_GO_ONLINE}"])
    if wandb.mode == "online":
        return Derivation(problems=[f"{asked} asks for mode online, but {_NO_KEY}; {_GO_ONLINE}, or set mode: "
                                    f"offline (WANDB_MODE=offline) and upload later with `wandb sync`"])
    ctx.warnings.append(f"{asked}: {_NO_KEY}; so this run logs to W&B offline (files under log_dir or WANDB_DIR; "
                        f"`wandb sync` uploads them). {_GO_ONLINE[0].upper()}{_GO_ONLINE[1:]}; to say offline: "
                        f"WANDB_MODE=offline or the tracker's mode: offline; for no W&B: use_wandb: false, or "
                        f"Levanter's --trainer.tracker.type noop")
    offline = WandbTrackerArgs(mode="offline")
    if wandb.source == "use_wandb":  # the flat keys have no mode: the tracker block carries it (same W&B run)
        blocks = ctx.get("tracker")
        blocks = blocks if isinstance(blocks, list) else [blocks] if blocks else []
        return Derivation({"use_wandb": False, "tracker": [*blocks, offline]})
    tracker = ctx.get("tracker")
    if isinstance(tracker, list):
        return Derivation(respelled={"tracker": [b.model_copy(update={"mode": "offline"}) if b.type == "wandb" else b
                                                 for b in tracker]})
    return Derivation(respelled={"tracker": tracker.model_copy(update={"mode": "offline"})})


@deriver
def derive_save_interval(ctx: RuleContext) -> Derivation:
    """``save_interval: 15min`` becomes seconds so the trainer never parses phrases."""
    value = ctx.get("save_interval")
    if value is None or isinstance(value, int):
        return Derivation()
    try:
        seconds = parse_duration(value)
    except TimePhraseError:
        return Derivation()  # save_interval_is_duration reports it with file:line
    # the user's value in seconds: provenance stays theirs (cli, file:line), not "derived"
    return Derivation(respelled={"save_interval": int(round(seconds))})


# --- finalize ---------------------------------------------------------------------------------------
def finalize(resolved: ResolvedConfig, world_size: int, device: Device | None = None) -> ResolvedConfig:
    """Derive, check and split ``resolved`` for ``world_size`` ranks; returns ``resolved`` itself.

    Derived values are set on ``resolved.args`` and recorded as ``derived`` in
    ``resolved.provenance``; ``resolved.deepspeed_config`` is filled. Raises one ConfigError that
    lists every problem.
    """
    args, provenance = resolved.args, resolved.provenance
    ctx = RuleContext(args=args, provenance=provenance, world_size=world_size, device=device or Device.detect(),
                      warnings=resolved.warnings, skipped=resolved.skipped, entry_point=resolved.entry_point)
    problems: list[str] = []
    for derive in DERIVATIONS:
        result = derive(ctx)
        problems.extend(result.problems)
        for key, value in result.values.items():
            if getattr(args, key) != value:
                # a changed value no longer reads as written in any file, so it is "derived"
                setattr(args, key, value)
                provenance[key] = DERIVED
        for key, value in result.respelled.items():
            setattr(args, key, value)
    problems.extend(check(ctx, check_modules.ordered_rules()))
    problems.extend(extra_args_problems(args, provenance))
    if problems:
        raise ConfigError(format_problems(problems))
    resolved.deepspeed_config = deepspeed_config(args, provenance)
    problems = deepspeed_problems(resolved.deepspeed_config, provenance)
    if problems:
        raise ConfigError(format_problems(problems))
    return resolved


def format_problems(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    listed = "\n".join(f"  - {problem}" for problem in problems)
    return f"{len(problems)} problems in the config:\n{listed}"
