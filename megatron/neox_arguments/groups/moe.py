"""Mixture-of-experts settings.

Deepy does not build MoE layers yet: every key is accepted only at its default, so a dense config
validates and an MoE config fails loudly instead of training a dense model.
"""

from __future__ import annotations

from typing import Literal

from megatron.neox_arguments.schema import ArgGroup, not_supported


class MoEArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsMoE`` group."""

    moe_num_experts: int = not_supported(1)
    """Experts per MoE layer; 1 means a dense model."""

    moe_expert_interval: int = not_supported(1)
    """Use an MoE layer every this many blocks."""

    moe_top_k: int = not_supported(1)
    """Experts each token is routed to."""

    moe_router_type: Literal["sinkhorn", "topk"] = not_supported("sinkhorn")
    """Routing algorithm: Sinkhorn balancing or plain top-k."""

    moe_lbl_in_fp32: bool = not_supported(False)
    """Compute the load-balancing loss in fp32."""

    moe_jitter_eps: float | None = not_supported(None)
    """Multiplicative noise on router inputs during training."""
