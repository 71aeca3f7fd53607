"""Before-launch checks of the training length (``train_iters`` / ``train_epochs``, declared in
``megatron/training/config.py``). Registered with every other check (``megatron/config_rules.py``).
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule


@rule
def iterations_or_epochs(ctx: RuleContext) -> list[str]:
    iters, epochs = ctx.get("train_iters"), ctx.get("train_epochs")
    if iters is not None and epochs is not None:
        return [f"both {ctx.show('train_iters')} and {ctx.show('train_epochs')} are set: keep one"]
    if iters is None and epochs is None:
        return ["neither train_iters nor train_epochs is set: give the training length as one of them"]
    return []


@rule
def training_length_positive(ctx: RuleContext) -> list[str]:
    if ctx.get("train_iters") == 0:
        return [f"{ctx.show('train_iters')}: a run needs at least one step (train_iters >= 1)"]
    return []
