"""Before-launch checks of the checkpoint keys (``megatron/checkpointing/config.py``): a save directory
goes with a save schedule, and ``save_interval`` is a duration. Registered with every other check
(``megatron/config_rules.py``).
"""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule
from megatron.time_phrases import TimePhraseError, parse_duration


SAVE_SCHEDULE_KEYS = ("checkpoint_factor", "extra_save_iters", "save_interval", "keep")


@rule
def save_has_schedule(ctx: RuleContext) -> list[str]:
    scheduled = [key for key in SAVE_SCHEDULE_KEYS if ctx.get(key) not in (None, [], "")]
    if ctx.get("save") and not scheduled:
        return [
            f"{ctx.show('save')} but no save schedule: add checkpoint_factor (save every N steps), "
            f"extra_save_iters, save_interval (e.g. 15min) or keep"
        ]
    if scheduled and not ctx.get("save"):
        shown = ", ".join(ctx.show(key) for key in scheduled)
        return [f"{shown} but save (the checkpoint directory) is not set: add save: <dir> or remove them"]
    return []


@rule
def save_interval_is_duration(ctx: RuleContext) -> list[str]:
    value = ctx.get("save_interval")
    if value is None:
        return []
    try:
        parse_duration(value)
    except TimePhraseError as err:
        return [f"{ctx.show('save_interval')}: {err}"]
    return []
