"""The engine's keys, and what it reads of a run besides them.

:class:`EngineArgs` declares how the model is built for training (compiled blocks, ZeRO-3 construction),
beside the code that reads them (``megatron/engine/build.py``); the one argument object (``NeoXArgs``) is
composed of it. The engine and the memory estimate also read keys other components declare (``seq_length``
and ``precision`` with the model, ``seed`` with the process keys, the batch sizes with DeepSpeed's,
``train_iters`` with the loop): :class:`EngineRun` holds the engine's keys with those values, resolved once
(``RunConfig.engine``), so neither the engine nor generation reads them from the trainer's view.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config_schema import ArgGroup
from megatron.data.batch import RankBatch

# precision key -> the name the device peak table and the memory estimate use
_COMPUTE_DTYPE = {"bfloat16": "bf16", "fp16": "fp16", "fp32": "fp32", None: "fp32"}


def compute_dtype(precision: str | None) -> str:
    """``fp32 | bf16 | fp16``: the compute dtype the ``precision`` key (``bfloat16``, ``fp16``,
    ``fp32`` or unset) trains in."""
    return _COMPUTE_DTYPE[precision]


class EngineArgs(ArgGroup):
    """Deepy's own group: how the engine builds the model (GPT-NeoX has neither key; its neighbours are
    under ``NeoXArgsTraining``)."""

    compile_layers: bool = False
    """Wrap each transformer block in torch.compile."""

    zero_init: bool = False
    """Build the model under deepspeed.zero.Init (ZeRO-3 only; fms-fsdp's low_cpu_fsdp): each layer's
    weights are partitioned as soon as they are made, so no rank ever holds the whole model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRun:
    """What the engine builder and the memory estimate read besides the component groups: the engine's keys
    (``keys``, its own instance of :class:`EngineArgs`) and the values of keys other components declare,
    resolved once above (``RunConfig.engine``)."""

    keys: EngineArgs
    """The engine's keys: compiled blocks, ZeRO-3 construction."""
    seq_length: int
    """Tokens per sample (the model's key)."""
    precision: str | None
    """The compute precision (the model's key: ``bfloat16``, ``fp16``, ``fp32`` or unset)."""
    seed: int
    """The run's seed (the process keys')."""
    batch: RankBatch
    """Micro batch and accumulation (DeepSpeed's keys, solved before launch)."""
    train_iters: int | None
    """The loop's optimizer steps, which the LR schedule spans; None: ``train_epochs`` sizes them once the
    train split is built (the trainer hands ``build_engine`` the resolved count)."""
