"""The keys of hang detection (``hang_watch.py``) and of torch.distributed's collective timeouts
(``megatron/initialize.py``), apart from them so the launcher reads them without torch.

torchtitan's ``comm.init_timeout_seconds``/``comm.train_timeout_seconds`` (torchtitan/config/configs.py:318,321
@b5bcd76): the process groups are created with the first (torchtitan/distributed/utils.py:555) and, after the first
step of *this* launch, every group gets the second after a barrier (torchtitan/trainer.py:1059,
distributed/utils.py:563 ``set_pg_timeouts``). Deepy does the same. torchtitan's defaults are 300 s and 100 s;
Deepy's are 3600 s and 1800 s (its process groups had 1800 s throughout before): a rank may wait in a barrier
while rank 0 alone indexes data at start-up or writes an HF save, which takes minutes for large models; and the
hang watch (``hang_timeout`` 20 min, ``startup_hang_timeout`` 45 min) must fire before a collective times out, or no
rank is left to write its stacks and name the stuck one (refused otherwise).
"""

from __future__ import annotations

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup
from megatron.time_phrases import TimePhraseError, parse_duration


class HangArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): what makes a rank that stopped making progress end the run (and, with
    ``max_restarts``, restart it), and torch.distributed's timeouts."""

    hang_timeout: str | int | None = "20min"
    """A rank that makes no progress for this long in one phase of training (data, forward/backward, save,
    evaluation) ends the run: every rank that can writes its Python stacks to `<run_dir>/hangs/`, the stuck
    rank and phase are named, and `max_restarts` restarts it. A time phrase (`30min`, `90s`) or seconds; null: off."""

    startup_hang_timeout: str | int | None = "45min"
    """As `hang_timeout`, for start-up: from the rank's start until its first step begins (imports, rendezvous,
    checkpoint load, data indexing). null: off."""

    init_timeout_seconds: int = Field(3600, ge=1)
    """torch.distributed's timeout of every collective from the rendezvous through the first step of a launch
    (torchtitan's `comm.init_timeout_seconds`; its default is 300)."""

    train_timeout_seconds: int = Field(1800, ge=1)
    """torch.distributed's timeout of every collective after the first step of a launch: a collective a peer
    never joins fails after this long (torchtitan's `comm.train_timeout_seconds`; its default is 100)."""

    def hang_limits(self) -> tuple[float | None, float | None]:
        """(``startup_hang_timeout``, ``hang_timeout``) in seconds; None where off."""
        return (None if self.startup_hang_timeout is None else parse_duration(self.startup_hang_timeout),
                None if self.hang_timeout is None else parse_duration(self.hang_timeout))


@rule
def hang_timeouts(ctx: RuleContext) -> list[str]:
    """Time phrases that read, and a hang watch that fires before the collective it watches times out (else no
    rank is left to write its stacks and name the stuck one)."""
    problems = []
    seconds: dict[str, float] = {}
    for key in ("hang_timeout", "startup_hang_timeout"):
        value = ctx.get(key)
        if value is None:
            continue
        try:
            seconds[key] = parse_duration(value)
        except TimePhraseError as err:
            problems.append(f"{ctx.show(key)}: {err}")
    pairs = (("hang_timeout", "train_timeout_seconds"), ("startup_hang_timeout", "init_timeout_seconds"))
    for watch, collective in pairs:
        limit = ctx.get(collective)
        if watch in seconds and isinstance(limit, int) and seconds[watch] >= limit:
            problems.append(f"{ctx.show(watch)} is not shorter than {ctx.show(collective)}: a rank waiting for a "
                            f"stuck peer would fail in its collective before the hang watch writes the stacks and "
                            f"names the stuck rank; make {watch} shorter, or {collective} longer")
    return problems
