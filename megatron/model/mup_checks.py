"""Before-launch checks of the muP keys (``megatron/model/mup_config.py``, applied by ``megatron/model/mup.py``).
Registered with every other check (``megatron/neox_arguments/check_modules.py``). What GPT-NeoX ea7aefd8 does with
each combination is in docs/mup.md.
"""

from __future__ import annotations

import os

from megatron.config_rules import RuleContext, rule, zero_stage

NORMAL_INITS = ("normal", "scaled_normal", "single_residual_scaled_normal", "wang_init", "small_init")
"""The init methods Deepy's muP rescales (``megatron/model/mup.py`` ``NORMAL_INITS``, which imports torch)."""

WIDTH_SCALED_INITS = ("small_init", "wang_init")
"""Normal inits whose std GPT-NeoX computes from hidden_size (sqrt(2 / 5h), 2 / (L sqrt(h)))."""

_MUP_ONLY = ("coord_check", "save_base_shapes", "mup_init_scale", "mup_attn_temp", "mup_output_temp",
             "mup_embedding_mult", "mup_width_scale")
"""Keys that change nothing without use_mup (mup_rp_embedding_mult does: GPT-NeoX multiplies the positions always)."""


@rule
def mup_keys_need_use_mup(ctx: RuleContext) -> list[str]:
    if ctx.get("use_mup"):
        return []
    given = [key for key in _MUP_ONLY if ctx.given(key) and ctx.get(key) != ctx.args.model_fields[key].default]
    if not given:
        return []
    return [f"{', '.join(ctx.show(k) for k in given)} but {ctx.show('use_mup')}: GPT-NeoX ea7aefd8 reads these only "
            "with use_mup (training.py, word_embeddings.py); set use_mup: true or remove them"]


@rule
def mup_needs_base_shapes(ctx: RuleContext) -> list[str]:
    """GPT-NeoX's get_model reads ``f"{base_shapes_file}.{rank}"`` (``None.0`` when unset) with mup.set_base_shapes."""
    if not ctx.get("use_mup"):
        return []
    path = ctx.get("base_shapes_file")
    if not path:
        return [f"{ctx.show('use_mup')} needs base_shapes_file: the muP base shapes (write them once with "
                "save_base_shapes: true and a base_shapes_file path, docs/mup.md)"]
    if not ctx.get("save_base_shapes") and not os.path.isfile(path):
        return [f"{ctx.show('base_shapes_file')}: no such file; write it first with save_base_shapes: true "
                "(the run then exits), then train with the same base_shapes_file"]
    return []


@rule
def mup_init_is_a_normal_init(ctx: RuleContext) -> list[str]:
    problems = []
    if not ctx.get("use_mup"):
        return []
    for key in ("init_method", "output_layer_init_method"):
        value = ctx.get(key)
        if value in WIDTH_SCALED_INITS:
            ctx.warnings.append(f"{ctx.show('use_mup')} with {ctx.show(key)}: its std shrinks with hidden_size "
                                "(GPT-NeoX's formula), on top of muP's own scaling, so activations shrink with width "
                                "(the coordinate check shows it); normal or scaled_normal keep them flat")
        if value in NORMAL_INITS:
            continue
        if "orthogonal" in value:
            why = ("GPT-NeoX ea7aefd8 cannot either: its mup re-init calls the orthogonal init with use_mup=True, "
                   "which it does not take (init_functions.py)")
        else:
            why = "Deepy's muP rescales normal inits only (megatron/model/mup.py)"
        problems.append(f"{ctx.show('use_mup')} with {ctx.show(key)}: {why}; use one of {list(NORMAL_INITS)}")
    return problems


@rule
def mup_needs_whole_parameters(ctx: RuleContext) -> list[str]:
    """ZeRO-3 builds the model partitioned: mup.set_base_shapes would read the placeholders' empty shapes."""
    if not ctx.get("use_mup") or zero_stage(ctx) < 3:
        return []
    return [f"{ctx.show('use_mup')} with zero_optimization stage 3: GPT-NeoX ea7aefd8 builds the model under "
            "deepspeed.zero.Init and then reads the partitioned parameters' shapes for mup.set_base_shapes, which "
            "cannot work either; use ZeRO stage 0-2"]


@rule
def mup_covers_every_trained_weight(ctx: RuleContext) -> list[str]:
    if not ctx.get("use_mup"):
        return []
    problems = []
    if int(ctx.get("lora_r") or 0) > 0:
        problems.append(f"{ctx.show('use_mup')} with {ctx.show('lora_r')}: LoRA adapters have no muP base shapes "
                        "(Deepy's adapters are not in GPT-NeoX); train without adapters or without muP")
    prompt = ctx.get("soft_prompt_tuning")
    if isinstance(prompt, dict) and prompt.get("enabled"):
        problems.append(f"{ctx.show('use_mup')} with soft_prompt_tuning enabled: the base shapes file is written "
                        "without the prompt, so mup.set_base_shapes refuses the model (GPT-NeoX ea7aefd8 too)")
    if ctx.get("train_impl") != "normal":
        problems.append(f"{ctx.show('use_mup')} with {ctx.show('train_impl')}: Deepy applies muP to the trained "
                        "language model only; its frozen reference (dpo, kto) and reward head (rm) are built without "
                        "the muP multipliers; use train_impl: normal")
    return problems


@rule
def coord_check_runs_unsharded(ctx: RuleContext) -> list[str]:
    if not (ctx.get("use_mup") and ctx.get("coord_check")) or ctx.tp == 1:
        return []
    return [f"{ctx.show('coord_check')} with {ctx.show('model_parallel_size')}: Deepy's coordinate check trains "
            "whole (unsharded) models of each width with mup's get_coord_data; run it with model_parallel_size 1"]


@rule
def mup_attention_scale_is_one_over_head_dim(ctx: RuleContext) -> list[str]:
    """GPT-NeoX ea7aefd8 transformer.py: use_mup sets norm_factor = head_dim, replacing sqrt(d) x layer, but its
    softmax still multiplies the scores by the layer coefficient, so layer l's scores become l q.k / d."""
    if not (ctx.get("use_mup") and ctx.get("apply_query_key_layer_scaling")):
        return []
    return [f"{ctx.show('use_mup')} with {ctx.show('apply_query_key_layer_scaling')}: GPT-NeoX ea7aefd8 then scales "
            "layer l's attention scores by l / head_dim (muP's norm factor replaces the coefficient the softmax still "
            "applies), which Deepy does not build; set apply_query_key_layer_scaling: false"]
