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


@rule
def epoch_cap_has_epochs(ctx: RuleContext) -> list[str]:
    """``max_train_epochs`` counts passes over files: it needs train_iters (the schedule it cuts short)
    and data that has epochs."""
    if ctx.get("max_train_epochs") is None:
        return []
    if ctx.get("train_epochs") is not None:
        return [f"{ctx.show('max_train_epochs')} and {ctx.show('train_epochs')} are both set: train_epochs already "
                f"ends the run after its epochs; keep one"]
    if ctx.get("use_dummy_dataset"):
        return [f"{ctx.show('max_train_epochs')}: the dummy dataset has no epochs (it is generated without end); "
                f"remove max_train_epochs or train on files"]
    return []


@rule
def eval_micro_batch_without_pipeline(ctx: RuleContext) -> list[str]:
    """DeepSpeed's pipeline engine evaluates the micro-batches it was configured with."""
    if ctx.get("eval_micro_batch_size_per_gpu") is not None and ctx.uses_pipeline_module:
        return [f"{ctx.show('eval_micro_batch_size_per_gpu')}: a pipeline engine (pipe_parallel_size >= 1) evaluates "
                f"in training's micro-batches; remove it or set pipe_parallel_size: 0"]
    return []
