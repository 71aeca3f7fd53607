"""Before-launch checks of shared blocks (``num_unique_layers``), the fp16 cross-entropy
(``fp16_lm_cross_entropy``), soft prompts (``soft_prompt_tuning``) and fp32 Mamba parameters
(``mamba_selective_fp32_params``). Registered with every other check
(``megatron/neox_arguments/check_modules.py``); docs/model_options.md has the facts and their sources.
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, block_enabled, rule, zero_stage
from megatron.model.family_config import configured_families, expand_layer_types
from megatron.model.layer_sharing import sharing_owners
from megatron.model.soft_prompt_settings import SOFT_PROMPT_KEYS


@rule
def unique_layers_divide_layers(ctx: RuleContext) -> list[str]:
    """GPT-NeoX's own two checks (``arguments.py:1293-1312``, ea7aefd8)."""
    unique, layers = ctx.get("num_unique_layers"), ctx.get("num_layers")
    if unique is None or layers is None:
        return []
    if unique > layers:
        return [f"{ctx.show('num_unique_layers')} must be smaller than or equal to {ctx.show('num_layers')}"]
    if layers % unique:
        return [f"{ctx.show('num_layers')} must be divisible by {ctx.show('num_unique_layers')}: each parameter "
                f"set runs at num_layers / num_unique_layers positions"]
    return []


@rule
def shared_blocks_are_alike(ctx: RuleContext) -> list[str]:
    """Positions that share a block run one module: same layer type, same MoE-ness."""
    unique, layers = ctx.get("num_unique_layers"), ctx.get("num_layers")
    if unique is None or layers is None or unique > layers or layers % unique:
        return []
    owners = sharing_owners(layers, unique, ctx.get("param_sharing_style"))
    try:
        types = expand_layer_types(ctx.get("attention_config") or [[["global"], layers]], layers)
    except ValueError:
        return []  # the attention_config check says why
    experts, interval = int(ctx.get("moe_num_experts") or 1), max(1, int(ctx.get("moe_expert_interval") or 1))
    problems = []
    for i, owner in enumerate(owners):
        if types[i] != types[owner]:
            problems.append(f"layer {i} is {types[i]!r} but shares the parameters of layer {owner} ({types[owner]!r})")
        elif experts > 1 and (i % interval == 0) != (owner % interval == 0):
            problems.append(f"layer {i} and layer {owner} share parameters but only one of them is an MoE layer "
                            f"({ctx.show('moe_expert_interval')})")
    if not problems:
        return []
    return [f"{ctx.show('num_unique_layers')} with {ctx.show('param_sharing_style')}: {'; '.join(problems[:3])}: "
            f"a shared block is one module, so its positions must be the same kind of layer; change "
            f"attention_config or the sharing"]


@rule
def shared_blocks_checkpoint_one_at_a_time(ctx: RuleContext) -> list[str]:
    """Without a pipeline, a chunk of k blocks is recomputed from its first module (``engine/build.py``
    ``wrap_layers``); a module that runs at several positions cannot start one chunk and end another."""
    if ctx.get("num_unique_layers") is None or int(ctx.get("pipe_parallel_size") or 0) >= 1:
        return []
    if not ctx.get("checkpoint_activations") or ctx.get("selective_checkpointing") \
            or int(ctx.get("checkpoint_num_layers") or 1) == 1:
        return []
    return [f"{ctx.show('checkpoint_num_layers')} with {ctx.show('num_unique_layers')} and "
            f"{ctx.show('pipe_parallel_size')}: shared blocks are recomputed one at a time without a pipeline; set "
            f"checkpoint_num_layers: 1, or pipe_parallel_size: 1 (DeepSpeed's PipelineModule recomputes chunks of "
            f"positions)"]


@rule
def fp16_cross_entropy_needs_fp16(ctx: RuleContext) -> list[str]:
    """GPT-NeoX refuses it unless precision is fp16 (``arguments.py:1314-1320``, ea7aefd8)."""
    if not ctx.get("fp16_lm_cross_entropy"):
        return []
    problems = []
    if not (ctx.get("precision") == "fp16" or block_enabled(ctx.get("fp16"))):
        problems.append(f"{ctx.show('fp16_lm_cross_entropy')} computes the loss from fp16 logits, but "
                        f"precision is {ctx.get('precision') or 'fp32'}: GPT-NeoX allows it in fp16 mode only; set "
                        f"precision: fp16 (or an fp16 block with enabled: true), or remove fp16_lm_cross_entropy")
    if float(ctx.get("z_loss") or 0.0) > 0:
        problems.append(f"{ctx.show('fp16_lm_cross_entropy')} with {ctx.show('z_loss')}: the z-loss (a Deepy "
                        f"extra) comes from the fp32 cross-entropy's pass; use one of them")
    return problems


@rule
def soft_prompt_entries(ctx: RuleContext) -> list[str]:
    """The entries GPT-NeoX's code reads (``training.py:907-915``), nothing else: its docstring's ``num_tokens`` is
    read by no code (``n_tokens`` is)."""
    value = ctx.get("soft_prompt_tuning")
    if value is None:
        return []
    unknown = sorted(set(value) - set(SOFT_PROMPT_KEYS))
    problems = []
    if unknown:
        hint = " (GPT-NeoX's code reads n_tokens; its help text's num_tokens is read by nothing)" \
            if "num_tokens" in unknown else ""
        problems.append(f"{ctx.show('soft_prompt_tuning')} has entries {unknown} that nothing reads{hint}; the "
                        f"entries are {', '.join(SOFT_PROMPT_KEYS)}")
    n_tokens, init_range = value.get("n_tokens", 10), value.get("init_range", 0.5)
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        problems.append(f"{ctx.show('soft_prompt_tuning')}: n_tokens must be a whole number of prompt vectors >= 1")
    if not isinstance(init_range, (int, float)) or isinstance(init_range, bool) or init_range < 0:
        problems.append(f"{ctx.show('soft_prompt_tuning')}: init_range must be a number >= 0")
    if not isinstance(value.get("init_string", ""), str) or not isinstance(value.get("enabled", False), bool):
        problems.append(f"{ctx.show('soft_prompt_tuning')}: init_string is a string and enabled a boolean")
    return problems


@rule
def soft_prompt_runs_where_built(ctx: RuleContext) -> list[str]:
    """The prompt is prepended to whole sequences on the embedding's stage and dropped before the final norm."""
    value = ctx.get("soft_prompt_tuning")
    if not value or not value.get("enabled", False):
        return []
    limits = [
        (int(ctx.get("pipe_parallel_size") or 0) > 1, "pipe_parallel_size",
         "the prompt lives on the first stage and its outputs are dropped on the last; use pipe_parallel_size 0 or 1"),
        (bool(ctx.get("sequence_parallel")), "sequence_parallel", "the prompt is prepended to the whole sequence"),
        (int(ctx.get("context_parallel_size") or 1) > 1, "context_parallel_size",
         "the prompt is prepended to the whole sequence"),
        (bool(ctx.get("reset_attention_mask")), "reset_attention_mask",
         "which documents of a packed sample would see the prompt is not defined"),
        (zero_stage(ctx) == 3, "zero_stage", "the prompt starts from the embedding table before ZeRO-3 partitions it"),
        (bool(ctx.get("eval_tasks")), "eval_tasks",
         "lm-eval runs the model with attention masks and a cache, which the prompt does not take yet"),
        (ctx.entry_point is not None and not ctx.trains, "soft_prompt_tuning",
         "generation and lm-eval run the model with a cache, which the prompt does not take yet"),
    ]
    return [f"{ctx.show('soft_prompt_tuning')} with {ctx.show(key)}: {why}" for refused, key, why in limits if refused]


@rule
def mamba_fp32_params_need_a_non_casting_engine(ctx: RuleContext) -> list[str]:
    """GPT-NeoX keeps A_log and D in fp32 under fp16/bf16 with DeeperSpeed's ``_deepspeed_no_cast`` (its
    ``mamba.py:171-189``, ea7aefd8). DeepSpeed 0.19.8 has no such mark: its engine casts every parameter to the
    training dtype (``runtime/engine.py`` ``_cast_module_mixed_precision``; ``keep_in_fp32_modules`` keeps buffers
    only), and its fp16/bf16 optimizers flatten each group into one dtype. Inference (generate.py, eval.py) builds
    no engine: there the parameters stay fp32."""
    if ctx.entry_point is not None and not ctx.trains:
        return []
    if not ctx.get("mamba_selective_fp32_params") or "mamba" not in configured_families(ctx.get("attention_config")):
        return []
    half = ctx.get("precision") in ("fp16", "bfloat16") or block_enabled(ctx.get("fp16")) \
        or block_enabled(ctx.get("bf16"))
    if not half:
        return []
    if not ctx.given("mamba_selective_fp32_params"):  # GPT-NeoX's default, which its own Mamba files rely on: said
        ctx.warnings.append(
            f"{ctx.show('mamba_selective_fp32_params')}: the Mamba layers' A_log and D are trained in "
            f"{ctx.get('precision') or 'the training dtype'} like every other weight (the scan computes in fp32), not "
            f"kept in fp32 as GPT-NeoX's DeeperSpeed keeps them: DeepSpeed 0.19.8 casts every parameter. Set "
            f"mamba_selective_fp32_params: false to say so")
        return []
    return [f"{ctx.show('mamba_selective_fp32_params')} keeps the Mamba layers' A_log and D in fp32 while training in "
            f"{ctx.get('precision') or 'half precision'}: that needs EleutherAI's DeeperSpeed (_deepspeed_no_cast); "
            f"DeepSpeed 0.19.8 casts every parameter to the training dtype. Set mamba_selective_fp32_params: false "
            f"(A_log and D in {ctx.get('precision') or 'the training dtype'} like the rest; the scan still computes "
            f"in fp32), or train in fp32"]
