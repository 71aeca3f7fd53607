"""Mixture-of-experts settings.

``moe_num_experts > 1`` replaces the MLP of every ``moe_expert_interval``-th block (block 0
first, as GPT-NeoX counts) with a dropless MoE layer: a router picks ``moe_top_k`` experts per
token and every token reaches them (no capacity, nothing dropped). The experts of a layer are
split over the tensor-parallel ranks (GPT-NeoX's layout) and, with ``moe_expert_parallel_size``,
further over groups of data-parallel ranks that exchange tokens with all-to-all.

GPT-NeoX's keys are the first six. Deepy adds what current MoE trainers offer and GPT-NeoX lacks:
the load-balancing loss coefficient, the router z-loss coefficient and expert parallelism over
data-parallel ranks (Megatron-LM's names where it has one). Not added: shared experts and a
capacity factor (the layer is dropless by design).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup, obsolete


class MoEArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsMoE`` group plus Deepy's additions."""

    moe_num_experts: int = Field(1, ge=1)
    """Experts per MoE layer; 1 means a dense model (no MoE layer at all)."""

    moe_expert_interval: int = Field(1, ge=1)
    """Use an MoE layer in every block whose index (0-based) is a multiple of this; the others keep a dense MLP."""

    moe_top_k: int = Field(1, ge=1)
    """Experts each token is routed to (its output is their outputs weighted by the router)."""

    moe_router_type: Literal["sinkhorn", "topk"] = "sinkhorn"
    """Routing: "topk" picks the k highest softmax scores; "sinkhorn" picks experts from a Sinkhorn-balanced
    assignment while training (weights: sigmoid of the logit for k=1, softmax for k>1) and plain top-k at
    evaluation."""

    moe_router_renormalize: bool = False
    """With moe_router_type "topk": divide each token's k weights by their sum, so they add up to 1 (Mixtral's
    router: HF's MixtralSparseMoeBlock, Levanter's MixtralSparseMoeBlock._route); false keeps the plain softmax
    probabilities, as GPT-NeoX. Deepy extra."""
    moe_lbl_in_fp32: bool = False
    """Compute the router's auxiliary losses (load balancing, z-loss) in fp32 instead of the training precision."""

    moe_jitter_eps: float | None = Field(None, ge=0.0, lt=1.0)
    """While training, multiply the router input by uniform noise in [1-eps, 1+eps] (None: no noise)."""

    moe_aux_loss_coeff: float = Field(0.0, ge=0.0)
    """Weight of the load-balancing loss (E * sum_e f_e * P_e per layer: token share f times mean router
    probability P; 1.0 when balanced) added to the objective; 0 logs it without training on it (GPT-NeoX adds
    none). Deepy extra, Megatron-LM's name."""

    moe_z_loss_coeff: float = Field(0.0, ge=0.0)
    """Weight of the router z-loss (mean squared logsumexp of the router logits, ST-MoE) added to the objective;
    0 logs it only. Deepy extra, Megatron-LM's name."""

    moe_expert_parallel_size: int = Field(1, ge=1)
    """Data-parallel ranks that split each MoE layer's experts between them and exchange tokens with all-to-all
    (beyond the split over model_parallel_size); 1 = every data-parallel rank holds all of its tensor-parallel
    rank's experts. Needs ZeRO stage 0 and fp32. Deepy extra."""

    # ---- keys of earlier GPT-NeoX releases (their DeepSpeed/megablocks MoE), kept so those configs load ----

    moe_type: Literal["megablocks", "deepspeed"] = "megablocks"
    """Earlier GPT-NeoX: which library's MoE layer to use. Both route without dropping tokens when
    moe_token_dropping is false, which is what Deepy's layer computes."""

    moe_token_dropping: bool = obsolete(
        False,
        "GPT-NeoX removed token dropping with its capacity keys (moe_train_capacity_factor, moe_eval_capacity_factor, "
        "moe_min_capacity) in commit d11df961 (#1210, May 2025): its MoE at ea7aefd8, like Deepy's, is dropless; "
        "use moe_token_dropping: false (every token reaches its experts)",
        values=(True,))
    """Earlier GPT-NeoX: drop the tokens beyond an expert's capacity (DeepSpeed MoE's drop_tokens, or megablocks'
    capacity-bound MoE). Gone from GPT-NeoX since May 2025; only false (dropless) is accepted."""

    enable_expert_tensor_parallelism: bool = False
    """Earlier GPT-NeoX: split each expert's weights over the tensor-parallel ranks. Deepy places
    whole experts on the tensor-parallel ranks instead; the maths is the same, only the placement
    differs."""
