"""Before-launch checks of the Mamba, RWKV-6 and gMLP layers' keys (``family_config.py``), registered with
every other check (``megatron/config_rules.py``). The shape rules also run when the model is built
(:meth:`megatron.model.config.GPTConfig.check_architecture` through a ``ConfigView``).

GPT-NeoX asserts some of these when it builds the layers (``mamba.py:45-51``, ``rwkv.py:278-298``,
``arguments.py:1105-1123``, commit ea7aefd8); the others are Deepy's: a fused kernel is honoured only
where its package and an NVIDIA GPU are, and is refused by name otherwise, and settings these layers
cannot honour (document masks, sequence parallelism through an RWKV layer) are refused instead of
ignored.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from megatron.config_rules import RuleContext, rule
from megatron.launcher.checks import runs_on_this_machine
from megatron.model.checks import ModelKeys
from megatron.model.family_config import (
    FAMILY_OF_TYPE,
    FamilyName,
    configured_families,
    family_of,
    mamba_shape,
    rwkv_derived_shape,
)

Finder = Callable[[str], Any]

FUSED_KERNELS: dict[str, tuple[FamilyName, tuple[tuple[str, str], ...]]] = {
    "mamba_selective_scan_fusion": ("mamba", (("mamba_ssm", "mamba-ssm"),)),
    "mamba_causal_conv_fusion": ("mamba", (("causal_conv1d", "causal-conv1d"),)),
    "mamba_inner_func_fusion": ("mamba", (("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d"))),
    "rwkv_wkv_fusion": ("rwkv", (("fla", "flash-linear-attention"),)),
}
"""key -> (the family whose layers it speeds up, (module, pip package) it needs)."""


def layer_families(ctx: ModelKeys) -> set[FamilyName]:
    return configured_families(ctx.get("attention_config"))


def shape_problems(ctx: ModelKeys) -> list[str]:
    """The layers' own shape rules (GPT-NeoX's assertions, and its derived keys given other values)."""
    families = layer_families(ctx)
    problems: list[str] = []
    if families & {"mamba", "rwkv"} and ctx.get("intermediate_size") and ctx.get("expansion_factor"):
        problems.append(f"{ctx.show('intermediate_size')} and {ctx.show('expansion_factor')} both size the "
                        f"Mamba/RWKV inner width: keep one")
    if "rwkv" in families and ctx.get("hidden_size") and ctx.get("num_attention_heads"):
        shape = rwkv_derived_shape(_Keys(ctx))
        for key, value in (("hidden_size", shape.hidden), ("dim_att", shape.dim_att), ("ffn_dim", shape.ffn)):
            if value % 32 or value == 0:
                problems.append(f"RWKV layers need {key}={value} to be a positive multiple of 32 (GPT-NeoX's kernel)")
        if shape.dim_att % shape.heads:
            problems.append(f"RWKV layers split dim_att={shape.dim_att} into {ctx.show('num_attention_heads')} "
                            f"heads: pick a head count that divides it")
        derived = {"head_size": shape.head_size, "ffn_dim": shape.ffn}
        for key, value in derived.items():
            given = ctx.get(key)
            if given is not None and given != value:
                problems.append(f"{ctx.show(key)}: GPT-NeoX derives it as {value} for these sizes "
                                f"(dim_att / num_attention_heads, or intermediate_size / expansion_factor); "
                                f"remove it or set it to {value}")
    return problems


class _Keys:
    """Attribute access to a check's keys, for the size formulas (which read ``config.hidden_size``)."""

    def __init__(self, ctx: ModelKeys) -> None:
        self._ctx = ctx

    def __getattr__(self, key: str) -> Any:
        return self._ctx.get(key)


@rule
def family_shapes(ctx: RuleContext) -> list[str]:
    return shape_problems(ctx)


def tensor_parallel_splits(config: Any) -> dict[str, tuple[int, tuple[str, ...]]]:
    """What tensor parallelism splits in these layers (name -> (size, the keys that set it)), as GPT-NeoX splits
    them: a Mamba layer's inner channels, a gMLP layer's inner width; RWKV layers are replicated (GPT-NeoX has
    no tensor-parallel RWKV)."""
    families = {family_of(t) for t in config.attention_types}
    splits: dict[str, tuple[int, tuple[str, ...]]] = {}
    if "mamba" in families:
        splits["the Mamba inner width (intermediate_size / expansion_factor * hidden_size)"] = (
            mamba_shape(config).inner, ("intermediate_size", "expansion_factor", "hidden_size"))
    if "gmlp" in families:
        splits["the gMLP inner width (4 * hidden_size)"] = (4 * config.hidden_size, ("hidden_size",))
    return splits


SPLIT_NORMS = ("layernorm", "non_parametric_layernorm", "te_layernorm", "rmsnorm", "te_rmsnorm", "scalenorm")
"""The norms a gMLP layer's spatial gate normalises over its tensor-parallel split (statistics summed over the ranks,
``gmlp._norm_over_ranks``: torch's LayerNorm, Deepy's RMSNorm and ScaleNorm)."""


@rule
def gmlp_norm_splits_over_tensor_parallel(ctx: RuleContext) -> list[str]:
    """A plug-in norm in a gMLP layer at tensor parallelism: its statistics over the split width are not built."""
    if ctx.tp <= 1 or "gmlp" not in layer_families(ctx) or ctx.get("norm") in SPLIT_NORMS:
        return []
    return [f"{ctx.show('norm')} in gMLP layers with {ctx.show('model_parallel_size')}: the spatial gate normalises "
            f"over a width tensor parallelism splits, built for {', '.join(SPLIT_NORMS)} only; use one of them or "
            f"model_parallel_size: 1"]


def kernel_problems(ctx: RuleContext, find_spec: Finder | None = None) -> list[str]:
    """A fused kernel needs its package and an NVIDIA GPU where the ranks run; refused here when they
    run on this machine without them, a warning when they run elsewhere."""
    find = find_spec or importlib.util.find_spec
    families = layer_families(ctx)
    problems: list[str] = []
    for key, (family, packages) in FUSED_KERNELS.items():
        if not ctx.get(key):
            continue
        if family not in families:
            problems.append(f"{ctx.show(key)} speeds up {family} layers, but attention_config has none: remove it")
            continue
        missing = [package for module, package in packages if find(module) is None]
        needs = []
        if missing:
            needs.append(f"the {' and '.join(repr(p) for p in missing)} package{'s' if len(missing) > 1 else ''} "
                         f"(pip install {' '.join(missing)})")
        if not ctx.device.cuda:
            needs.append("an NVIDIA GPU (its kernels are CUDA-only)")
        if not needs:
            continue
        message = (f"{ctx.show(key)} needs {' and '.join(needs)}, not found here; set {key}: false to run "
                   f"Deepy's PyTorch path (same maths)")
        if runs_on_this_machine(ctx):
            problems.append(message)
        else:
            ctx.warnings.append(f"{message}; the ranks run on other machines and need them there")
    return problems


@rule
def fused_kernels_available(ctx: RuleContext) -> list[str]:
    return kernel_problems(ctx)


@rule
def fused_mamba_inner(ctx: RuleContext) -> list[str]:
    if not ctx.get("mamba_inner_func_fusion"):
        return []
    problems = []
    if ctx.get("mamba_use_bias_in_linears"):
        problems.append(f"{ctx.show('mamba_inner_func_fusion')} cannot add the projections' biases "
                        f"({ctx.show('mamba_use_bias_in_linears')}); GPT-NeoX refuses this too: drop one")
    if ctx.tp > 1:
        problems.append(f"{ctx.show('mamba_inner_func_fusion')} with {ctx.show('model_parallel_size')}: the fused "
                        f"function cannot sum the B/C/step-size projection over tensor-parallel ranks, so it would "
                        f"compute another model; use mamba_selective_scan_fusion and mamba_causal_conv_fusion instead")
    return problems


@rule
def families_read_whole_sequences(ctx: RuleContext) -> list[str]:
    families = layer_families(ctx) - {"transformer"}
    if not families:
        return []
    names = ", ".join(sorted(families))
    problems = []
    if ctx.get("reset_attention_mask"):
        problems.append(f"{ctx.show('reset_attention_mask')}: {names} layers read the whole packed sequence "
                        f"(GPT-NeoX's too), so documents would see each other; remove it")
    if "rwkv" in families and ctx.get("sequence_parallel") and ctx.tp > 1:
        problems.append(f"{ctx.show('sequence_parallel')}: RWKV layers are not split over tensor-parallel ranks "
                        f"and need the whole sequence on each; remove it")
    return problems


__all__ = ["FAMILY_OF_TYPE", "FUSED_KERNELS", "kernel_problems", "layer_families", "shape_problems",
           "tensor_parallel_splits"]
