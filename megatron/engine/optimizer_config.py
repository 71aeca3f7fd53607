"""The optimizer's keys: the DeepSpeed-style ``optimizer`` block, its flat GPT-NeoX alternatives
(``optimizer_type``, ``lr``, ``weight_decay``) and the ZeRO shortcuts. GPT-NeoX files them under
``NeoXArgsOptimizer``, except ``weight_decay`` (``NeoXArgsTraining``) and the block
(``NeoXArgsDeepspeedConfig``).

Declared here, beside the optimizers that read them (``megatron/engine/optimizers.py``); the one
argument object (``NeoXArgs``) is composed of this class and the trainer hands the optimizer builders
that object, typed as this class. Which builder, the peak rate, the weight decay and the type's own
parameters are worked out from the block and the flat keys by the properties below, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from megatron.config_schema import BITSANDBYTES, ArgGroup, needs_gpu_library, not_supported
from megatron.errors import ConfigError
from megatron.engine.optimizer_block import OPTIMIZER_KINDS, PARAMS_OF_KIND, OptimizerBlock

OptimizerType = Literal[
    "adam",
    "onebitadam",
    "cpu_adam",
    "cpu_torch_adam",
    "sm3",
    "madgrad_wd",
    "sgd",
    "lion",
    "adopt",
    "rmsprop_momentum",
    "muon",
    "scion",
    "mars",
    "cautious",
    "sophia_h",
    "kron",
    "soap",
    "adam_mini",
]


def peak_lr_setting(lr: float | None, block: OptimizerBlock | None) -> tuple[float | None, str]:
    """The one decision of the peak learning rate: the flat ``lr`` when given, else the block's
    ``optimizer.params.lr``; with the key that holds it (for messages), and ``(None, "lr")`` when
    neither is set. The optimizer, the schedule, the pre-launch rules and ``deepy.py``'s inference
    fill-in all ask here; a block lr that disagrees with a given flat lr is refused by the rules
    (``learning_rates_ordered``), so which one wins never changes a run."""
    if lr is not None:
        return float(lr), "lr"
    if block is not None and block.params.lr is not None:
        return float(block.params.lr), "optimizer.params.lr"
    return None, "lr"


class OptimizerArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsOptimizer`` group."""

    optimizer_type: OptimizerType = "adam"
    """Optimizer family, picked from Deepy's optimizer registry (also settable through the
    DeepSpeed-style optimizer block)."""

    use_bnb_optimizer: bool = needs_gpu_library(False, BITSANDBYTES)
    """Adam (optimizer.type Adam/AdamW) becomes bitsandbytes' Adam8bit (8-bit optimizer state), and learned
    position embeddings become bitsandbytes' StableEmbedding (a LayerNorm after the lookup, 32-bit optimizer
    state), as GPT-NeoX does."""

    zero_stage: int | list[int] | Literal["all"] | None = None
    """ZeRO stage (0-3) to use, a list of stages to try, or `all`; normally set inside
    zero_optimization."""

    zero_reduce_scatter: bool | None = None
    """ZeRO: reduce gradients with reduce-scatter instead of all-reduce."""

    zero_contiguous_gradients: bool | None = None
    """ZeRO: copy gradients into one contiguous buffer as produced, avoiding fragmentation."""

    zero_reduce_bucket_size: int | None = Field(None, ge=1)
    """ZeRO: number of elements reduced at once."""

    zero_allgather_bucket_size: int | None = Field(None, ge=1)
    """ZeRO: number of elements all-gathered at once."""

    lr: float | None = Field(None, ge=0)
    """Peak learning rate; normally read from optimizer.params.lr."""

    # GPT-NeoX files these two under other groups (NeoXArgsTraining, NeoXArgsDeepspeedConfig); they are
    # the optimizer's, so they are declared here.
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay applied to weight matrices."""

    weight_decay_embeddings: bool = True
    """Deepy addition: decay the token and position embeddings too (GPT-NeoX does; Levanter's default
    mask does not, and its dialect sets this false). Biases and norms are never decayed."""

    optimizer: OptimizerBlock | None = None
    """Optimizer block: {type: Adam, params: {lr, betas, eps, ...}}; type is one of Adam, AdamW,
    CPU_Adam, CPU_torch_adam, OneBitAdam, SM3, madgrad_wd, Lion, SGD, ADOPT,
    RMSPropMomentum, Muon, Scion, MARS, Cautious, SophiaH, SOAP, AdamMini and params are checked per type."""

    @property
    def optimizer_kind(self) -> str:
        """Registry key in ``megatron.engine.optimizers.OPTIMIZERS`` (``adam``, ``sgd``, ...): the
        block's type when there is a block, else ``optimizer_type``."""
        return self.optimizer.kind if self.optimizer is not None else OPTIMIZER_KINDS[self.optimizer_type]

    @property
    def optimizer_type_shown(self) -> str:
        """The type as the user wrote it (for messages)."""
        return self.optimizer.type if self.optimizer is not None else self.optimizer_type

    @property
    def peak_lr(self) -> float:
        """The peak rate :func:`peak_lr_setting` decides (the rules refuse a run with neither key)."""
        lr, _ = peak_lr_setting(self.lr, self.optimizer)
        if lr is None:
            raise ConfigError("no learning rate: set optimizer.params.lr (or lr)")
        return lr

    @property
    def applied_weight_decay(self) -> float:
        """``optimizer.params.weight_decay`` when the block gives it, else the flat ``weight_decay``."""
        block_wd = self.optimizer.params.weight_decay if self.optimizer is not None else None
        return block_wd if block_wd is not None else self.weight_decay

    @property
    def optimizer_params(self) -> Mapping[str, Any]:
        """The type's own parameters (betas, eps, momentum, ...), validated by the schema. Without a
        block (the flat GPT-NeoX alternative) the type's defaults, GPT-NeoX's, fill every parameter as
        an empty block of that type would. ``lr``/``weight_decay`` are read through the properties
        above; ``max_grad_norm`` is gradient_clipping in apex's spelling: DeepSpeed clips, not the
        optimizer."""
        params = self.optimizer.params if self.optimizer is not None else PARAMS_OF_KIND[self.optimizer_kind]()
        return params.model_dump(exclude={"lr", "weight_decay", "max_grad_norm"})
