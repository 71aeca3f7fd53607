"""Before-launch checks of the mixture-of-experts keys (``megatron/model/moe_config.py``): the keys need
experts, top-k fits, experts split evenly over tensor and expert parallelism, and what expert
parallelism over data-parallel ranks supports. Registered with every other check
(``megatron/config_rules.py``).
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, block_enabled, default_of, rule, zero_source, zero_stage
from megatron.model.checks import ModelKeys


MOE_DEFAULTS_IRRELEVANT_WHEN_DENSE = (
    "moe_top_k", "moe_router_type", "moe_router_renormalize", "moe_expert_interval", "moe_lbl_in_fp32", "moe_jitter_eps",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_parallel_size",
)  # fmt: skip


@rule
def moe_keys_need_experts(ctx: RuleContext) -> list[str]:
    if int(ctx.get("moe_num_experts") or 1) > 1:
        return []
    changed = [key for key in MOE_DEFAULTS_IRRELEVANT_WHEN_DENSE if ctx.get(key) != default_of(ctx.args, key)]
    if not changed:
        return []
    return [
        f"{', '.join(ctx.show(key) for key in changed)} but {ctx.show('moe_num_experts')}: these only "
        f"configure MoE layers, and a model with one expert has none; set moe_num_experts to 2 or more, "
        f"or remove them"
    ]


@rule
def moe_router_renormalize_needs_topk(ctx: ModelKeys) -> list[str]:
    if not ctx.get("moe_router_renormalize") or ctx.get("moe_router_type") == "topk":
        return []
    return [f"{ctx.show('moe_router_renormalize')} renormalises top-k routing weights, but "
            f"{ctx.show('moe_router_type')}: set moe_router_type: topk"]


@rule
def moe_top_k_fits(ctx: ModelKeys) -> list[str]:
    experts, k = int(ctx.get("moe_num_experts") or 1), int(ctx.get("moe_top_k") or 1)
    if experts <= 1 or k <= experts:
        return []
    return [f"{ctx.show('moe_top_k')} exceeds {ctx.show('moe_num_experts')}: a token can visit each expert once"]


@rule
def moe_experts_split_evenly(ctx: RuleContext) -> list[str]:
    experts = int(ctx.get("moe_num_experts") or 1)
    ep = int(ctx.get("moe_expert_parallel_size") or 1)
    if experts <= 1:
        return []
    problems = []
    if experts % (ctx.tp * ep) != 0:
        problems.append(
            f"{ctx.show('moe_num_experts')} is not divisible by {ctx.show('model_parallel_size')} x "
            f"{ctx.show('moe_expert_parallel_size')} = {ctx.tp * ep}: each of those ranks holds an equal "
            f"share of whole experts; use a multiple of {ctx.tp * ep} experts or smaller parallel sizes"
        )
    if ep > 1 and ctx.dp is not None and ctx.dp % ep != 0:
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} does not divide the data-parallel size {ctx.dp} "
            f"(world size {ctx.world_size} / model_parallel_size {ctx.tp} / pipeline stages {ctx.pp}): "
            f"experts are split over groups of that many data-parallel ranks; pick a divisor of {ctx.dp}"
        )
    return problems


@rule
def moe_expert_parallel_over_dp_needs_fp32_without_zero(ctx: RuleContext) -> list[str]:
    ep = int(ctx.get("moe_expert_parallel_size") or 1)
    if ep <= 1 or int(ctx.get("moe_num_experts") or 1) <= 1:
        return []
    problems = []
    stage = zero_stage(ctx)
    if stage != 0:
        # DeepSpeed's ZeRO optimizers partition and all-gather parameters over the whole
        # data-parallel group, which assumes every data-parallel rank holds the same parameters;
        # its own expert support is tied to its MoE layer class and checkpoint format.
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} with ZeRO stage {stage} ({zero_source(ctx)}) is not "
            f"supported yet: ZeRO shards the optimizer over data-parallel ranks that would hold different "
            f"experts; use ZeRO stage 0, or moe_expert_parallel_size: 1 (experts split over "
            f"model_parallel_size only, which works with every ZeRO stage)"
        )
    half = block_enabled(ctx.get("fp16")) or block_enabled(ctx.get("bf16")) or ctx.get("precision") in (
        "fp16", "bfloat16")  # fmt: skip
    if half:
        # DeepSpeed's fp16/bf16 optimizers reduce their own flat fp32 gradient buffers, which Deepy's
        # expert-gradient reduction (over the ranks that hold the same experts) does not reach.
        problems.append(
            f"{ctx.show('moe_expert_parallel_size')} with precision={ctx.get('precision')} is not supported "
            f"yet: expert parallelism over data-parallel ranks trains in fp32 only; set precision: fp32, "
            f"or moe_expert_parallel_size: 1"
        )
    return problems
