"""Before-launch checks of the LoRA adapter keys (``megatron/model/lora_config.py``, built by
``megatron/model/lora.py``). Registered with every other check (``megatron/config_rules.py``).
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule


_LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_target_modules")


_LORA_MLP_TARGETS = ("dense_h_to_4h", "dense_4h_to_h")


@rule
def lora_keys_need_a_rank(ctx: RuleContext) -> list[str]:
    if int(ctx.get("lora_r") or 0) > 0:
        return []
    given = [key for key in _LORA_KEYS if ctx.given(key)]
    if not given:
        return []
    return [f"{', '.join(ctx.show(k) for k in given)} but {ctx.show('lora_r')}: these configure LoRA adapters, "
            "and lora_r 0 trains without any; set lora_r (e.g. 8) or remove them"]


@rule
def lora_mlp_targets_need_dense_mlps(ctx: RuleContext) -> list[str]:
    if int(ctx.get("lora_r") or 0) == 0 or int(ctx.get("moe_num_experts") or 1) <= 1:
        return []
    mlp = [t for t in ctx.get("lora_target_modules") or [] if t in _LORA_MLP_TARGETS]
    if not mlp:
        return []
    return [f"{ctx.show('lora_target_modules')} with {ctx.show('moe_num_experts')}: adapters on the experts of MoE "
            f"layers are not built yet, so {mlp} would stay unadapted there; target query_key_value/dense only"]
