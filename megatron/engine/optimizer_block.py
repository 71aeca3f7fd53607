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
    "muon": "muon",
    "scion": "scion",
    "mars": "mars",
    "cautious": "cautious",
    "sophiah": "sophia_h",
    "sophia_h": "sophia_h",
    "sophia-h": "sophia_h",
    "kron": "kron",
    "soap": "soap",
    "adammini": "adam_mini",
    "adam_mini": "adam_mini",
    "adam-mini": "adam_mini",
}
SHOWN_TYPES = ("Adam", "AdamW", "CPU_Adam", "CPU_torch_adam", "OneBitAdam", "SM3", "madgrad_wd", "Lion", "SGD",
               "ADOPT", "RMSPropMomentum", "Muon", "Scion", "MARS", "Cautious", "SophiaH", "Kron",
               "SOAP", "AdamMini")


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


class MuonParams(_Params):
    """Levanter's ``MuonConfig`` (``src/levanter/optim/muon.py:24-47`` of stanford-crfm/levanter@9263f81e): ``lr``
    is Levanter's ``learning_rate``, the Muon half's (its ``lr: 0.02`` field is never read by ``build``). The update:
    ``megatron/engine/levanter_whole_tensor_optim.py``."""

    adam_lr: float = Field(6e-4, ge=0)
    """Peak rate of the AdamW half (embeddings, output layer, biases, norms), on the same schedule as ``lr``."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Muon's momentum (undamped: ``buf = momentum * buf + g``)."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise ``momentum * buf + g`` rather than ``buf``."""
    backend_steps: int = Field(5, ge=1)
    """Newton-Schulz iterations."""
    muon_epsilon: float = Field(1e-8, ge=0)
    """Added to the Frobenius norm the Newton-Schulz iteration first divides by."""
    use_kimi_scaling: bool = False
    """Scale a matrix's update by ``0.2 * sqrt(max(out, in))`` (Moonshot's) instead of ``sqrt(max(1, out / in))``."""
    betas: Betas = (0.9, 0.95)
    """Levanter's ``beta1``/``beta2`` of the AdamW half."""
    eps: float = Field(1e-8, ge=0)
    """Levanter's ``epsilon`` of the AdamW half."""
    inner_max_grad_norm: float | None = Field(1.0, ge=0)
    """Levanter's ``max_grad_norm``, applied where Levanter applies it: inside the optimizer, to the AdamW half's
    gradients by their own global norm (Muon's are not clipped); None or 0: no clip. ``gradient_clipping`` must
    then be 0 (checked before launch)."""
    orthogonalise_sections: bool = False
    """Orthogonalise each section of a fused matrix apart: the query, key and value rows of ``query_key_value`` and
    the gate and up rows of a gated ``dense_h_to_4h``, as Levanter's Llama-family models hold them (separate
    ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``, each its own Newton-Schulz and
    ``sqrt(max(1, out/in))``). False: the fused matrix whole, as Levanter's GPT-2 holds ``c_attn``. The Levanter dialect sets it from
    ``model.type`` (true for every type but gpt2)."""


class ScionParams(_Params):
    """Levanter's ``ScionConfig`` (``src/levanter/optim/scion.py:22-38``@9263f81e): ``lr`` is Levanter's
    ``learning_rate``, the Scion half's (its ``lr: 0.02`` field is never read by ``build``)."""

    scion_to_signum_lr: float = Field(0.25, ge=0)
    """The signum half's rate (embeddings, output layer, biases, norms) as a fraction of ``lr``."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Scion's momentum (damped: ``buf = momentum * buf + (1 - momentum) * g``)."""
    backend_steps: int = Field(10, ge=1)
    """Newton-Schulz iterations."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """The signum half's momentum."""
    scion_epsilon: float = Field(1e-8, ge=0)
    """Added to the Frobenius norm the Newton-Schulz iteration first divides by."""
    inner_max_grad_norm: float | None = Field(1.0, ge=0)
    """Levanter's ``max_grad_norm`` inside the optimizer: the signum half's gradients clipped by their own global
    norm (Scion's are not); None or 0: no clip. ``gradient_clipping`` must then be 0 (checked before launch)."""
    orthogonalise_sections: bool = False
    """Orthogonalise each section of a fused matrix apart: the query, key and value rows of ``query_key_value`` and
    the gate and up rows of a gated ``dense_h_to_4h``, as Levanter's Llama-family models hold them (separate
    ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``, each its own Newton-Schulz and
    ``sqrt(max(1, out/in))``). False: the fused matrix whole, as Levanter's GPT-2 holds ``c_attn``. The Levanter dialect sets it from
    ``model.type`` (true for every type but gpt2)."""


class MarsParams(_Params):
    """Levanter's ``MarsConfig`` (``src/levanter/optim/mars.py:16-30``@9263f81e)."""

    betas: Betas = (0.95, 0.99)
    """Levanter's ``beta1``/``beta2``."""
    gamma: float = Field(0.025, ge=0)
    """Weight of the gradient correction ``gamma * b1 / (1 - b1) * (g - g_prev)``."""
    eps: float = Field(1e-8, ge=0)
    """Levanter's ``epsilon``."""
    inner_max_grad_norm: float | None = Field(1.0, ge=0)
    """Levanter's ``max_grad_norm`` inside ``scale_by_mars``: the corrected gradients ``c`` scaled by
    ``min(1, max_grad_norm / (||c|| + 1e-6))``; None or 0: no clip. ``gradient_clipping`` must then be 0."""


class CautiousParams(_Params):
    """Levanter's ``CautiousConfig`` (``src/levanter/optim/cautious.py:16-30``@9263f81e); its ``gamma`` is never
    read by ``build``, and its ``max_grad_norm`` is ``gradient_clipping`` (a global clip before the optimizer)."""

    betas: Betas = (0.95, 0.95)
    """Levanter's ``beta1``/``beta2``."""
    eps: float = Field(1e-8, ge=0)
    """Levanter's ``epsilon``: in Adam's denominator and added to the mask's mean."""


class KronParams(_Params):
    """Levanter's ``KronConfig`` (``src/levanter/optim/kron.py:90-112`` of stanford-crfm/levanter@9263f81e; its
    ``weight_decay`` default 0.1 is ``weight_decay`` and its ``max_grad_norm`` 1.0 is ``gradient_clipping``, a global
    clip before the optimizer that Levanter skips with ``normalize_grads``): the update is in
    ``megatron/engine/levanter_kron.py``. Not taken: ``mu_dtype`` (the parameter's), ``precond_dtype`` (float32),
    the matmul precisions, ``lax_map_*`` and the sharding fields."""

    beta1: float = Field(0.9, ge=0, lt=1)
    """Momentum of the gradient (bias-corrected); 0: none."""
    normalize_grads: bool = False
    """Divide each gradient by its norm first."""
    preconditioner_update_probability: float = Field(0.05, gt=0, le=1)
    """The final probability of a preconditioner update: 1.0 for ``update_prob_flat_start`` steps, then
    ``exp(-0.001 (step - update_prob_flat_start))`` down to this; an update runs when a counter reaches 1/p."""
    update_prob_flat_start: int = 500
    """Steps with a preconditioner update every step."""
    max_size_triangular: int = Field(25000, ge=1)
    """A dimension longer than this gets a diagonal factor."""
    min_ndim_triangular: int = Field(2, ge=0)
    """A parameter with fewer dimensions gets diagonal factors only."""
    memory_save_mode: Literal["one_diag", "all_diag"] | None = None
    """one_diag: each parameter's largest dimension diagonal; all_diag: every dimension."""
    preconditioner_lr: float = Field(0.1, gt=0)
    """The factors' step size (normalised by the update's norm lower bound)."""
    preconditioner_init_scale: float = Field(1.0, gt=0)
    """The factors start as scale**(1/ndim) times the identity (or ones)."""
    merge_small_dims: bool = True
    """Merge a parameter's small dimensions towards ``target_merged_dim_size`` first (Levanter's heuristic)."""
    target_merged_dim_size: int = Field(8192, ge=1)
    """The merged size the merge aims at."""
    partition_grads_into_blocks: bool = True
    """Cut each (merged) parameter into ``block_size`` blocks along its triangular dimensions."""
    block_size: int = Field(256, ge=1)
    """The blocks' side; every block is zero-padded to a multiple of it."""
    probe_seed: int = Field(0, ge=0)
    """Seed of the preconditioner updates' Gaussian probes (torch's generator, with the step and the parameter's
    place; Levanter's are JAX's, from ``PRNGKey(0)``)."""


class SoapParams(_Params):
    """Levanter's ``SoapConfig`` (``src/levanter/optim/soap.py:29-49`` of stanford-crfm/levanter@9263f81e; its
    ``weight_decay`` default is 0.0 and ``max_grad_norm`` 1.0 is ``gradient_clipping``): the update is in
    ``megatron/engine/levanter_soap.py``. Levanter's ``mu_dtype``/``precond_dtype`` (None: the parameter's) are not
    taken: the state is in the parameter's dtype."""

    betas: Betas = (0.95, 0.95)
    """Levanter's ``beta1`` (Adam's momentum, in the parameter's basis) and ``beta2`` (its second moment, in the
    preconditioners' eigenbasis)."""
    shampoo_beta: float = Field(0.95, lt=1)
    """Decay of the preconditioners' EMA of gradient outer products (negative: ``beta2``)."""
    eps: float = Field(1e-8, gt=0)
    """Levanter's ``epsilon``: added to the square root of the second moment, and to the diagonal of the first
    eigendecomposition."""
    precondition_frequency: int = Field(10, ge=1)
    """The eigenbases are refreshed (one QR power iteration) every this many steps."""
    max_precond_dim: int = Field(10000, ge=1)
    """A dimension this long or longer gets no preconditioner (the vocabulary)."""
    merge_small_dims: bool = True
    """Merge a parameter's small dimensions towards ``target_merged_dim_size`` first (Levanter's heuristic)."""
    target_merged_dim_size: int = Field(2048, ge=1)
    """The merged size the merge aims at."""
    one_diag: bool = False
    """Precondition only the first eligible dimension of each block."""
    partition_grads_into_blocks: bool = True
    """Cut each (merged) parameter into ``block_size`` blocks, each preconditioned on its own."""
    block_size: int = Field(256, ge=1)
    """The blocks' side; every block is zero-padded to a multiple of it."""


class AdamMiniParams(_Params):
    """Levanter's ``MiniConfig`` (``src/levanter/optim/adam_mini.py:20-35``@9263f81e; its ``weight_decay`` default
    is 0.0, its ``lr: 0.02`` and ``nesterov`` are never read by ``build``): the update is in
    ``megatron/engine/levanter_adam_mini.py``."""

    betas: Betas = (0.9, 0.95)
    """Levanter's ``beta1``/``beta2`` (both halves)."""
    eps: float = Field(1e-8, ge=0)
    """Levanter's ``epsilon`` (both halves)."""
    inner_max_grad_norm: float | None = Field(1.0, ge=0)
    """Levanter's ``max_grad_norm``, applied where Levanter applies it: inside the optimizer, to the AdamW half's
    gradients (norms, the MLP's biases) by their own global norm; the blockwise half is not clipped. None or 0: no
    clip. ``gradient_clipping`` must then be 0 (checked before launch)."""


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


class MuonBlock(_Block):
    params: MuonParams = MuonParams()


class ScionBlock(_Block):
    params: ScionParams = ScionParams()


class MarsBlock(_Block):
    params: MarsParams = MarsParams()


class CautiousBlock(_Block):
    params: CautiousParams = CautiousParams()


class SophiaHBlock(_Block):
    params: SophiaHParams = SophiaHParams()


class KronBlock(_Block):
    params: KronParams = KronParams()


class SoapBlock(_Block):
    params: SoapParams = SoapParams()


class AdamMiniBlock(_Block):
    params: AdamMiniParams = AdamMiniParams()


PARAMS_OF_KIND: dict[str, type[_Params]] = {
    "adam": AdamParams, "cpu_adam": AdamParams, "onebitadam": OneBitAdamParams, "sm3": SM3Params,
    "madgrad_wd": MadgradParams, "lion": LionParams, "sgd": SGDParams, "adopt": AdoptParams,
    "rmsprop_momentum": RMSPropMomentumParams, "muon": MuonParams, "scion": ScionParams,
    "kron": KronParams,
    "mars": MarsParams, "cautious": CautiousParams, "sophia_h": SophiaHParams, "soap": SoapParams,
    "adam_mini": AdamMiniParams,
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
    | Annotated[MuonBlock, Tag("muon")]
    | Annotated[ScionBlock, Tag("scion")]
    | Annotated[MarsBlock, Tag("mars")]
    | Annotated[CautiousBlock, Tag("cautious")]
    | Annotated[SophiaHBlock, Tag("sophia_h")]
    | Annotated[KronBlock, Tag("kron")]
    | Annotated[SoapBlock, Tag("soap")]
    | Annotated[AdamMiniBlock, Tag("adam_mini")],
    Discriminator(
        _kind_of,
        custom_error_type="optimizer_type",
        custom_error_message=f"optimizer.type must be one of {', '.join(SHOWN_TYPES)}",
    ),
]
"""``{type, params}``: one of the blocks above, chosen by ``type``."""
