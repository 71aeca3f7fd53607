"""What ``deepy-gpu-check`` runs, in order, and how long each part may take.

Every check runs in a process of its own that is killed at its cap, so one hung or crashed part costs
its cap and no more, and the caps add up to less than ten minutes (``TEN_MINUTES``): the whole check
fits one device session. ``smoke`` marks the parts that also run on a CPU (``--smoke``, run by the test
suite); the rest need a GPU and measure nothing useful without one.
"""

from __future__ import annotations

from dataclasses import dataclass

TEN_MINUTES = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    name: str
    cap_s: float
    """Wall-clock seconds before the check's process is killed (its start and imports included)."""
    smoke: bool
    """Also runs on a CPU (with small shapes)."""
    measures: str


PLAN: tuple[Check, ...] = (
    Check(name="environment", cap_s=30, smoke=True,
          measures="GPU, memory, driver; torch, CUDA, cuDNN, NCCL, Triton, DeepSpeed; C compiler and Python.h "
                   "for compile_layers; CUDA_VISIBLE_DEVICES; the MFU table's peak for the device"),
    Check(name="attention", cap_s=60, smoke=True,
          measures="the SDPA kernel each Deepy attention variant gets (causal, GQA, sliding window, ALiBi, "
                   "rpe, packed documents) against Deepy's prediction; ms and peak memory per forward+backward"),
    Check(name="compile", cap_s=90, smoke=False,
          measures="compile_layers: first-step (compile) seconds, step ms after, graphs and graph breaks, "
                   "and the graphs of scale_attn_by_inverse_layer_idx (one, not one per layer)"),
    Check(name="sync_audit", cap_s=60, smoke=False,
          measures="torch.cuda.set_sync_debug_mode over two train_step calls: every host sync by file:line"),
    Check(name="memory_350m", cap_s=75, smoke=False,
          measures="the --dry-run memory estimate against torch.cuda.max_memory_allocated at the 350M shape "
                   "(bf16, ZeRO-1, micro batch 4, seq 2048)"),
    Check(name="trainer_125m", cap_s=120, smoke=False,
          measures="125M shape (bf16, seq 2048, batch 8): tokens/s and MFU of Deepy's train_step, and the "
                   "same model in a plain loop (the trainer's overhead)"),
    Check(name="tiny_resume", cap_s=150, smoke=False,
          measures="deepy.py end to end in bf16 with dropout: 8 steps saving at 4, then 4 -> 8 resumed; "
                   "the resumed losses equal the straight run's bit for bit"),
    Check(name="gpu_libraries", cap_s=15, smoke=False,
          measures="tests/unit/test_gpu_libraries_device.py: Transformer Engine's modules (te_* keys, te norms) "
                   "and bitsandbytes' (use_bnb_optimizer) against Deepy's layers; skipped where not installed"),
)


def total_cap(plan: tuple[Check, ...] = PLAN) -> float:
    return sum(c.cap_s for c in plan)


def select(names: list[str] | None, smoke: bool) -> tuple[Check, ...]:
    """The checks to run, in plan order: the named ones (``smoke`` then only shrinks their shapes), or
    every check, or with ``smoke`` the ones that run on a CPU."""
    known = {c.name for c in PLAN}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}: choose from {', '.join(c.name for c in PLAN)}")
    if names:
        return tuple(c for c in PLAN if c.name in names)
    return tuple(c for c in PLAN if c.smoke) if smoke else PLAN


def describe(plan: tuple[Check, ...]) -> str:
    """The ``--dry-run`` text: each part, its cap, and whether the caps fit ten minutes."""
    width = max(len(c.name) for c in plan)
    lines = [f"{'check':<{width}}  {'cap':>6}  {'CPU':>3}  measures"]
    lines += [f"{c.name:<{width}}  {c.cap_s:>5.0f}s  {'yes' if c.smoke else 'no':>3}  {c.measures}" for c in plan]
    total = total_cap(plan)
    verdict = "fits" if total <= TEN_MINUTES else "does NOT fit"
    lines.append(f"{'total':<{width}}  {total:>5.0f}s       the caps {verdict} ten minutes ({TEN_MINUTES:.0f} s)")
    return "\n".join(lines)
