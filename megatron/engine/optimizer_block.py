"""The GPT-NeoX/DeepSpeed ``optimizer: {type: ..., params: {...}}`` block as a typed union.

Each optimizer type has its own parameter model: numbers must be numbers, ``betas`` two of them, and
a parameter the optimizer does not take is an error naming the ones it does (``optimizer.params.lrr``
gets a did-you-mean) — all before anything is launched. ``type`` is matched case-insensitively, as
GPT-NeoX does (``Adam``, ``adam``, ``CPU_Adam``), and keeps the user's spelling.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from megatron.config_schema import ArgGroup

Betas = tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]]

# user's type (lower case) -> the kind that builds it
OPTIMIZER_KINDS: dict[str, str] = {
    "adam": "adam",
    "adamw": "adam",
    "cpu_torch_adam": "adam",
    "cpu_adam": "cpu_adam",
    "cpuadam": "cpu_adam",
    "onebitadam": "onebitadam",
    "sm3": "sm3",
    "madgrad_wd": "madgrad_wd",
    "lion": "lion",
    "sgd": "sgd",
    "adopt": "adopt",
    "rmspropmomentum": "rmsprop_momentum",
    "rmsprop_momentum": "rmsprop_momentum",
    "sophiah": "sophia_h",
    "sophia_h": "sophia_h",
    "sophia-h": "sophia_h",
}
SHOWN_TYPES = ("Adam", "AdamW", "CPU_Adam", "CPU_torch_adam", "OneBitAdam", "SM3", "madgrad_wd", "Lion", "SGD",
               "ADOPT", "RMSPropMomentum", "SophiaH")


class _Params(ArgGroup):
    lr: float | None = Field(None, ge=0)
    """Peak learning rate (or the flat ``lr`` key)."""
    weight_decay: float | None = Field(None, ge=0)
    """Decoupled weight decay for weight matrices; the flat ``weight_decay`` key is the other spelling."""


class AdamParams(_Params):
    betas: Betas = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    amsgrad: bool = False
    max_grad_norm: float | None = Field(None, gt=0)
    """Clip gradients to this global norm: apex FusedAdam's parameter, which GPT-NeoX's configuration
    guide still sets; the same setting as ``gradient_clipping``, and handed to DeepSpeed as that."""


class OneBitAdamParams(AdamParams):
    freeze_step: int = Field(100000, ge=0)
    """Steps of ordinary Adam before the compressed (1-bit) phase."""
    cuda_aware: bool = False
    comm_backend_name: Literal["nccl", "mpi", "compressed"] = "nccl"


class SM3Params(_Params):
    momentum: float = Field(0.0, ge=0, lt=1)
    beta: float = Field(0.0, ge=0, lt=1)
    eps: float = Field(1e-30, gt=0)


class MadgradParams(_Params):
    momentum: float = Field(0.9, ge=0, lt=1)
    eps: float = Field(1e-6, gt=0)


class LionParams(_Params):
    betas: Betas = (0.9, 0.99)


class SGDParams(_Params):
    momentum: float = Field(0.0, ge=0)
    dampening: float = Field(0.0, ge=0)
    nesterov: bool = False


class AdoptParams(_Params):
    """Levanter's ``AdoptConfig`` (``src/levanter/optim/adopt.py:18-31`` of stanford-crfm/levanter@9263f81e):
    its defaults, not the paper's or pytorch-optimizer's (those differ, see ``megatron/engine/levanter_optim.py``)."""

    betas: Betas = (0.9, 0.95)
    """Levanter's ``beta1``/``beta2``: decay of the momentum of normalised gradients and of the squared gradients."""
    eps: float = Field(1e-6, ge=0)
    """Levanter's ``epsilon``: added to the square root of the bias-corrected second moment."""


class RMSPropMomentumParams(_Params):
    """Levanter's ``RMSPropMomentumConfig`` (``src/levanter/optim/rmsprop.py:19-27``@9263f81e): RMSProp with
    bias-corrected, damped momentum; not ``torch.optim.RMSprop`` (see ``megatron/engine/levanter_optim.py``)."""

    betas: Betas = (0.9, 0.99)
    """Levanter's ``beta1`` (momentum) and ``beta2`` (mean square)."""
    eps: float = Field(1e-30, ge=0)
    """Levanter's ``eps``: added to the square root of the bias-corrected mean square."""


class SophiaHParams(_Params):
    """Levanter's ``SophiaHConfig`` (``src/levanter/optim/sophia.py:127-206`` and ``config.py:397-399`` of
    stanford-crfm/levanter@9263f81e; its ``weight_decay`` default is 0.1): the update and its Hessian estimate are in
    ``megatron/engine/levanter_sophia.py``."""

    betas: Betas = (0.96, 0.99)
    """Levanter's ``beta1`` (momentum of the gradients) and ``beta2`` (EMA of the Hessian-diagonal estimates)."""
    eps: float = Field(1e-12, gt=0)
    """Levanter's ``epsilon``: the floor of ``gamma * h`` the momentum is divided by."""
    gamma: float = Field(0.01, gt=0)
    """Levanter's ``gamma`` (``GAMMA_SOPHIA_H``): scales the Hessian estimate in the denominator."""
    clip_threshold: float | None = Field(1.0, gt=0)
    """Levanter's ``clip_threshold``: each element of the update is clipped to +-this (None: not clipped)."""
    update_interval: int = Field(10, ge=1)
    """Levanter's ``update_interval``: the Hessian diagonal is estimated after every this many steps."""
    rng_seed: int = Field(0, ge=0)
    """Levanter's ``rng_seed``: seeds the Gaussian probe vectors of the Hutchinson estimate."""


class _Block(ArgGroup):
    type: str
    """Optimizer type, case-insensitive."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value.lower() not in OPTIMIZER_KINDS:
            raise ValueError(_unknown_type(value))
        return value

    @property
    def kind(self) -> str:
        return OPTIMIZER_KINDS[self.type.lower()]


class AdamBlock(_Block):
    params: AdamParams = AdamParams()


class CPUAdamBlock(_Block):
    params: AdamParams = AdamParams()


class OneBitAdamBlock(_Block):
    params: OneBitAdamParams = OneBitAdamParams()


class SM3Block(_Block):
    params: SM3Params = SM3Params()


class MadgradBlock(_Block):
    params: MadgradParams = MadgradParams()


class LionBlock(_Block):
    params: LionParams = LionParams()


class SGDBlock(_Block):
    params: SGDParams = SGDParams()


class AdoptBlock(_Block):
    params: AdoptParams = AdoptParams()


class RMSPropMomentumBlock(_Block):
    params: RMSPropMomentumParams = RMSPropMomentumParams()


class SophiaHBlock(_Block):
    params: SophiaHParams = SophiaHParams()


PARAMS_OF_KIND: dict[str, type[_Params]] = {
    "adam": AdamParams, "cpu_adam": AdamParams, "onebitadam": OneBitAdamParams, "sm3": SM3Params,
    "madgrad_wd": MadgradParams, "lion": LionParams, "sgd": SGDParams, "adopt": AdoptParams,
    "rmsprop_momentum": RMSPropMomentumParams, "sophia_h": SophiaHParams,
}


def _unknown_type(value: Any) -> str:
    hint = difflib.get_close_matches(str(value).lower(), OPTIMIZER_KINDS, n=1)
    mean = f" (did you mean {hint[0]}?)" if hint else ""
    return f"unknown optimizer type {value!r}{mean}; choose one of {', '.join(SHOWN_TYPES)}"


def _kind_of(value: Any) -> str | None:
    """The union member a raw block belongs to (pydantic's discriminator callback)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return OPTIMIZER_KINDS.get(str(kind).lower()) if isinstance(kind, str) else None


OptimizerBlock = Annotated[
    Annotated[AdamBlock, Tag("adam")]
    | Annotated[CPUAdamBlock, Tag("cpu_adam")]
    | Annotated[OneBitAdamBlock, Tag("onebitadam")]
    | Annotated[SM3Block, Tag("sm3")]
    | Annotated[MadgradBlock, Tag("madgrad_wd")]
    | Annotated[LionBlock, Tag("lion")]
    | Annotated[SGDBlock, Tag("sgd")]
    | Annotated[AdoptBlock, Tag("adopt")]
    | Annotated[RMSPropMomentumBlock, Tag("rmsprop_momentum")]
    | Annotated[SophiaHBlock, Tag("sophia_h")],
    Discriminator(
        _kind_of,
        custom_error_type="optimizer_type",
        custom_error_message=f"optimizer.type must be one of {', '.join(SHOWN_TYPES)}",
    ),
]
"""``{type, params}``: one of the blocks above, chosen by ``type``."""
