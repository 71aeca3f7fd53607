"""Before-launch checks of the LoRA adapter keys (``megatron/model/lora_config.py``, built by
``megatron/model/lora.py``). Registered with every other check (``megatron/config_rules.py``).
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule
from megatron.model.family_config import configured_families
from megatron.objective_needs import needs_of


_LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_split_fused", "lora_init")


_LORA_MLP_TARGETS = ("dense_h_to_4h", "dense_4h_to_h")
_LORA_BLOCK_TARGETS = ("query_key_value", "dense", *_LORA_MLP_TARGETS)
"""The projections of a transformer block that ``lora.apply_lora`` adapts (Mamba, RWKV and gMLP layers have none)."""


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


@rule
def lora_head_needs_an_untied_head(ctx: RuleContext) -> list[str]:
    """output_layer is the untied head; a tied head is the token embedding, which no adapter adapts (Levanter's
    adapters sit on hnn.Linear only, lora.py:95-109@9263f81e; a tied head has none), and a reward model has none."""
    if int(ctx.get("lora_r") or 0) == 0 or "output_layer" not in (ctx.get("lora_target_modules") or []):
        return []
    if ctx.get("value_head"):
        return [f"{ctx.show('lora_target_modules')} with {ctx.show('value_head')}: a reward model has no output "
                "head (its value head trains); remove output_layer"]
    if not ctx.get("no_weight_tying"):
        return [f"{ctx.show('lora_target_modules')} with {ctx.show('no_weight_tying')}: the head is tied to the token "
                "embedding, which gets no adapter; remove output_layer, or untie the head (no_weight_tying: true)"]
    return []


@rule
def levanter_init_needs_its_own_reference(ctx: RuleContext) -> list[str]:
    """DPO's and KTO's reference is the starting model, taken as the base with its adapters switched off when the
    run starts without trained adapters (megatron/objectives/reference.py): right only when fresh
    adapters add nothing, as PEFT's (B zero) do and Levanter's (B drawn) do not."""
    if int(ctx.get("lora_r") or 0) == 0 or ctx.get("lora_init") != "levanter":
        return []
    impl = ctx.get("train_impl")
    if impl not in ("dpo", "kto"):
        return []
    return [f"{ctx.show('lora_init')} with {ctx.show('train_impl')}: Levanter's fresh adapters change the model, so "
            "the reference (the base with its adapters off) would not be the starting model; use lora_init: peft"]


@rule
def lora_targets_are_in_the_model(ctx: RuleContext) -> list[str]:
    """A LoRA run freezes the base and trains the adapters (and a reward model's value head): every rank needs some
    to train, or its optimizer has none (``optimizers.build_optimizer`` refuses "no trainable parameters"). The
    adapted projections are transformer blocks' (``_LORA_BLOCK_TARGETS``) and the untied head, which only the last
    pipeline stage holds."""
    if int(ctx.get("lora_r") or 0) == 0:
        return []

    targets = ctx.get("lora_target_modules") or []
    families = configured_families(ctx.get("attention_config"))
    in_blocks = "transformer" in families and any(t in _LORA_BLOCK_TARGETS for t in targets)
    head = "output_layer" in targets or needs_of(str(ctx.get("train_impl") or "normal")).value_head
    if in_blocks:
        return []
    if not head:
        return [f"{ctx.show('lora_target_modules')} names no projection of this model's layers "
                f"({', '.join(sorted(families))}: only transformer blocks have {', '.join(_LORA_BLOCK_TARGETS)}), so "
                "nothing would train; target projections the model has, or train without adapters (lora_r: 0)"]
    if ctx.pp > 1:
        return [f"{ctx.show('lora_target_modules')} with {ctx.show('pipe_parallel_size')}: only the last pipeline "
                "stage holds the head, so the ranks of the other stages would train nothing; add a projection of the "
                "transformer blocks (query_key_value, ...)"]
    return []
