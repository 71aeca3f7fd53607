"""Low-rank adapters (LoRA) for fine-tuning on a budget: Deepy extras, named after PEFT's ``LoraConfig``.

``lora_r > 0`` freezes every weight of the model and trains one adapter per targeted projection
(``megatron/model/lora.py``); the optimizer holds state for the adapters only. DPO and KTO then use
the starting model as their reference - the base with its adapters switched off, or set to those of the
checkpoint the run started from - so no second copy of the weights is kept.

Declared here, beside the adapters that read them (kept apart from ``lora.py`` so the argument layer
reads the keys without importing torch); the trainer hands the adapters the one argument object,
typed as :class:`LoRAArgs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from megatron.config_schema import ArgGroup

LoRATarget = Literal["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "output_layer"]
LoRAInit = Literal["peft", "levanter"]


class LoRAArgs(ArgGroup):
    """Deepy's adapter keys (no GPT-NeoX NeoXArgs group has them; PEFT's LoraConfig names them r,
    lora_alpha, lora_dropout, target_modules)."""

    lora_r: int = Field(0, ge=0)
    """Rank of every LoRA adapter; 0 trains all parameters without adapters. PEFT's r."""

    lora_alpha: float = Field(8.0, gt=0)
    """Adapter scale numerator: each adapter's output is multiplied by lora_alpha / lora_r. PEFT's lora_alpha."""

    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout applied to each adapter's input while training. PEFT's lora_dropout."""

    lora_target_modules: list[LoRATarget] = Field(default_factory=lambda: list[LoRATarget](["query_key_value"]),
                                                  min_length=1)
    """Projections that get an adapter, by GPT-NeoX module name (query_key_value and dense in attention,
    dense_h_to_4h and dense_4h_to_h in the MLP, output_layer the untied output head); PEFT's target_modules for
    GPT-NeoX models."""

    lora_split_fused: bool = False
    """One adapter per section of a fused projection: q, k and v of query_key_value, gate and up of a gated
    dense_h_to_4h, each with its own A and B, as PEFT and Levanter adapt a Llama's separate q_proj, k_proj, v_proj,
    gate_proj and up_proj. False: one adapter for the whole fused projection (PEFT on GPT-NeoX's query_key_value)."""

    lora_init: LoRAInit = "peft"
    """How the adapters start. peft: A uniform in +-1/sqrt(in), B zero (a fresh adapter changes nothing). levanter:
    both factors truncated normal in +-3 standard deviations over sqrt(fan in) (A: /sqrt(in), B: /sqrt(lora_r)),
    haliax's Linear.init as Levanter's LowRankLinear.init draws them, so the fresh model is not the base."""

    @property
    def lora_enabled(self) -> bool:
        """Adapters are attached (``lora_r > 0``); otherwise every parameter trains."""
        return self.lora_r > 0

    @property
    def lora_scale(self) -> float:
        """What each adapter's output is multiplied by: ``lora_alpha / lora_r``."""
        return self.lora_alpha / self.lora_r

    @staticmethod
    def of_record(args: dict[str, Any]) -> LoRAArgs:
        """The adapters a checkpoint's stored arguments describe (``lora_r == 0``: none); a key the record
        leaves out takes the schema's default. Generation and the HF export both read a checkpoint's
        adapters this way, whatever the config running them says."""
        return LoRAArgs.model_validate({key: args[key] for key in LoRAArgs.model_fields if args.get(key) is not None})

    def settings(self) -> dict[str, Any]:
        """The keys, by name (to build arguments that use these adapters)."""
        return {key: getattr(self, key) for key in LoRAArgs.model_fields}  # also on the composed NeoXArgs
