"""Module weights into a model whose parameters ZeRO-3 partitions: a weights-only start at stage 3 (a converter's
checkpoint here, a GPT-NeoX checkpoint in ``neox/load.py``), and the block ``reinit_tokens`` edits rows in.

A weights-only checkpoint (what the converters write, ``<save>/hf_import`` among them) holds the whole model in
its ``mp_rank_XX_model_states.pt`` and no ZeRO shards. DeepSpeed's ZeRO-3 loader reads only its own per-rank files
(``zero_pp_rank_N_mp_rank_XX_model_states.pt``) and rebuilds the module from the optimizer shards
(``zero_to_fp32``), neither of which such a checkpoint has; so the module state is read and loaded here instead:
``module.load_state_dict`` (strict, or as ``new_parameters.py`` patches it) runs unchanged while each module's own
parameters are gathered whole (``deepspeed.zero.GatheredParameters``, entered by every rank, rank 0's values kept
on exit), one module at a time, so the whole model never exists on one rank. DeepSpeed then copies the module's
new partitions into its fp32 master partitions (``refresh_fp32_params`` of the ZeRO-3 optimizer, as DeepSpeed's
own module-only load does at stage 1-2): the masters hold the module's values, in its dtype, as at stage 0-2.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn


def editing_whole(params: Sequence[torch.Tensor]) -> AbstractContextManager[Any]:
    """A block inside which ZeRO-3's partitioned ``params`` are whole on every rank (every rank enters it) and what
    rank 0 writes to them is kept: on exit rank 0's values are partitioned again. The ranks that write the same
    values (a load of the same tensors, a draw from the same seed) leave every partition as at stage 0-2."""
    # lazy: DeepSpeed, only for ZeRO-3 engines (the GPT-NeoX reader imports this module without it)
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


@contextmanager
def _gathered_per_module(root: nn.Module) -> Iterator[None]:
    """Within the block, ``root.load_state_dict`` sees each module's own parameters whole while that module (and
    its children) load: gathered by a load pre-hook, released (re-partitioned from rank 0's values) by the
    post-hook, which runs after the children."""
    open_blocks: list[ExitStack] = []

    def gather(module: nn.Module, *_: Any) -> None:
        stack = ExitStack()
        own = list(module.parameters(recurse=False))
        if own:
            stack.enter_context(editing_whole(own))
        open_blocks.append(stack)

    def release(_module: nn.Module, _incompatible: Any) -> None:
        open_blocks.pop().close()

    handles = []
    for module in root.modules():
        handles.append(module.register_load_state_dict_pre_hook(gather))
        handles.append(module.register_load_state_dict_post_hook(release))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while open_blocks:  # a load that stopped half-way: re-partition what is still gathered
            open_blocks.pop().close()


def load_into_partitioned(src: dict[str, torch.Tensor], dst: nn.Module, strict: bool = True) -> None:
    """``dst.load_state_dict(src, strict)`` (as patched, if it is) on a ZeRO-3 module, its parameters gathered
    module by module (every rank calls it, with the same ``src``). ``strict=False``: for a caller that has matched
    every tensor itself (the GPT-NeoX reader leaves out the buffers the model computes)."""
    with torch.no_grad(), _gathered_per_module(dst):
        dst.load_state_dict(src, strict=strict)


def load_whole_files(engine: Any, weights: dict[str, torch.Tensor], new_parameters: tuple[str, ...]) -> list[str]:
    """A weights-only checkpoint's module into a ZeRO-3 ``engine`` (every rank): ``weights``, this tp rank's model
    file under ``GPTModel`` names (``neox.canonical_rank_weights``, either naming, read by the caller), loaded
    gathered, then DeepSpeed's fp32 partitions refreshed from the module. ``new_parameters``: name prefixes that
    may start from their initialisation (``new_parameters.tolerating_new_parameters``). Returns notes for the log."""
    # lazy: DeepSpeed, only for ZeRO-3 engines (the GPT-NeoX reader imports this module without it)
    from megatron.checkpointing.new_parameters import tolerating_new_parameters

    with tolerating_new_parameters(engine, new_parameters) as report:
        load_into_partitioned(weights, engine.module)
    engine.optimizer.refresh_fp32_params()  # the fp32 master partitions from the module's new ones
    return report.notes()
