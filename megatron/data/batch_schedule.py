"""A global batch size that changes with the step (``train_batch_size_schedule``), as Levanter's
``trainer.train_batch_size: [{start, value}, ...]`` does (``levanter/schedule.py`` @ 9263f81e).

Levanter's rule, read from its code:
- step ``s`` uses the value of the last entry whose ``start <= s``; the last entry holds forever
  (``BatchSchedule.batch_size_at_step``, schedule.py:98-106@9263f81e; segments end at the next
  entry's start, schedule.py:86-96);
- the global data offset of step ``s`` is the samples of every earlier step:
  ``offset(segment) + (s - start) * value`` (``global_data_offset_by_step``, schedule.py:108-119), and
  step ``s`` reads the samples ``[offset(s), offset(s) + batch(s))`` (``batch_indices_at_step``,
  schedule.py:130-141; the loader reads them there, data/loader.py:166-170);
- the learning-rate schedule counts optimizer steps, whatever their batch (optax schedules of the step
  count, ``num_train_steps``).

In Deepy the micro batch is fixed and the gradient accumulation follows each step's batch
(``batch / (micro x dp)``); the consumed-sample count a checkpoint stores is the offset of the next
step, so a resume in the middle of the schedule reads exactly what the uninterrupted run would.
Pure arithmetic: no torch, the launcher checks configs with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSegment:
    """Steps ``[start, next segment's start)`` of ``size`` samples each, after ``offset`` samples."""

    start: int
    size: int
    offset: int


@dataclass(frozen=True, slots=True)
class BatchSchedule:
    """The global batch of every step and the global sample offset it starts at."""

    segments: tuple[BatchSegment, ...]

    @classmethod
    def of(cls, steps: Sequence[tuple[int, int]]) -> BatchSchedule:
        """From ``(start_step, global_batch)`` pairs, the first at step 0, starts increasing (checked
        before launch by :func:`schedule_problems`)."""
        segments: list[BatchSegment] = []
        offset = 0
        for i, (start, size) in enumerate(steps):
            if i:
                prev = segments[-1]
                offset += (start - prev.start) * prev.size
            segments.append(BatchSegment(start=int(start), size=int(size), offset=offset))
        if not segments or segments[0].start != 0:
            raise ValueError("a batch schedule starts at step 0")
        return cls(tuple(segments))

    @classmethod
    def fixed(cls, size: int) -> BatchSchedule:
        """One global batch for every step."""
        return cls((BatchSegment(start=0, size=size, offset=0),))

    def _segment(self, step: int) -> BatchSegment:
        found = self.segments[0]
        for seg in self.segments:
            if seg.start <= step:
                found = seg
        return found

    def batch_at(self, step: int) -> int:
        """Global samples of 0-based step ``step``."""
        return self._segment(step).size

    def offset_at(self, step: int) -> int:
        """Global samples read before 0-based step ``step`` (= consumed samples after ``step`` steps)."""
        seg = self._segment(step)
        return seg.offset + (step - seg.start) * seg.size

    def per_rank_at(self, step: int, dp: int) -> int:
        """Samples one of ``dp`` data-parallel ranks reads at step ``step``."""
        return self.batch_at(step) // dp

    def gas_at(self, step: int, micro: int, dp: int) -> int:
        """Micro-batches of ``micro`` samples per rank at step ``step`` (its gradient accumulation)."""
        return self.batch_at(step) // (micro * dp)

    def step_at_offset(self, offset: int) -> int | None:
        """The step that starts at global sample ``offset``; None when no step starts there."""
        for seg in reversed(self.segments):
            if offset >= seg.offset:
                steps, rest = divmod(offset - seg.offset, seg.size)
                return None if rest else seg.start + steps
        return None

    @property
    def sizes(self) -> tuple[int, ...]:
        """The distinct global batches, in order of first use."""
        return tuple(dict.fromkeys(seg.size for seg in self.segments))


def schedule_problems(steps: Sequence[object], micro: int, dp: int, first: int | None) -> list[str]:
    """What is wrong with ``train_batch_size_schedule`` (a list of ``{start_step, global_batch}``) for a
    micro batch of ``micro`` on ``dp`` data-parallel ranks, whose step 0 is ``first``
    (``train_batch_size``); messages start with what to fix, the caller names the key."""
    if not steps:
        return ["is empty: give at least {start_step: 0, global_batch: N}, or leave it out"]
    problems: list[str] = []
    last = -1
    for i, entry in enumerate(steps):
        if not isinstance(entry, dict) or set(entry) != {"start_step", "global_batch"} or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in entry.values()):
            problems.append(f"entry {i} ({entry!r}) is not {{start_step: int, global_batch: int}}")
            continue
        start, size = entry["start_step"], entry["global_batch"]
        if i == 0 and start != 0:
            problems.append(f"entry 0 starts at step {start}: the first entry starts at step 0")
        if i and start <= last:
            problems.append(f"entry {i} starts at step {start}, not after the previous entry ({last}): "
                            "give the entries in order of increasing start_step")
        last = start
        if size <= 0 or size % (micro * dp):
            problems.append(f"entry {i}: global_batch {size} is not a positive multiple of the micro batch x dp "
                            f"= {micro} x {dp} = {micro * dp} (the micro batch is fixed, gradient accumulation "
                            "follows the batch)")
    if not problems and first is not None and steps[0]["global_batch"] != first:  # type: ignore[index]
        problems.append(f"starts at global_batch {steps[0]['global_batch']} but train_batch_size is "  # type: ignore[index]
                        f"{first}: train_batch_size is step 0's batch; make them equal or drop train_batch_size")
    return problems


def schedule_pairs(steps: Sequence[dict[str, int]] | None) -> tuple[tuple[int, int], ...]:
    """The key's entries as ``(start_step, global_batch)`` pairs; () without a schedule."""
    return tuple((int(e["start_step"]), int(e["global_batch"])) for e in steps or ())
