"""Before-launch checks of the evaluation keys the loop's evaluator reads (``megatron/training/evaluate.py``)."""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule


@rule
def char_level_ppl_needs_text(ctx: RuleContext) -> list[str]:
    """``char_level_ppl`` counts the characters of the evaluated rows' ``text``, which only language modelling's
    batches hold (``train_impl: normal``; GPT-NeoX's ``CharCounter`` reads ``batch["text"]`` and fails on the
    pairs of the other objectives)."""
    if not ctx.get("char_level_ppl") or ctx.get("train_impl") == "normal":
        return []
    return [f"{ctx.show('char_level_ppl')} counts the characters of the evaluated text, which {ctx.show('train_impl')} "
            f"batches do not hold: remove char_level_ppl, or use train_impl: normal"]
