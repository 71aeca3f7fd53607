"""How every component checks its keys before launch: the context a check sees and the registry of
checks.

A check is a small function ``(ctx) -> list[str]`` registered with :func:`rule` in the module of the
component whose keys it protects (``megatron/model/checks.py``, ``megatron/data/checks.py``,
``megatron/engine/optimizer_checks.py``, ...; rules between several components stay in
``megatron/neox_arguments/rules.py``; every module that registers checks is listed in
``megatron/neox_arguments/check_modules.py``). It returns one message per problem, naming the user's
keys, their values and where they were set (``ctx.show(key)`` gives ``key=value (file:line)``) and
saying what to change. :func:`check` runs them all and the caller raises
*one* :class:`~megatron.errors.ConfigError` listing every problem.

The checks see the arguments *after* the derived values (batch sizes, precision, ...) are filled in; a
check whose inputs are missing stays quiet and leaves the report to the check about the missing key.
This module sits below the components and the argument layer: it imports neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from megatron import devices


CLI = "cli"
"""Provenance of a key set on the command line."""
DERIVED = "derived"
"""Provenance of a value Deepy computed from others."""
DEFAULT = "default"
"""Provenance of a key left at its default."""
INFERENCE_ENTRY_POINTS = ("generate.py", "eval.py")
"""The scripts that load a checkpoint's weights to run them, and neither resume nor save."""


class Device:
    """What the launching machine offers; injected so rules are testable without a GPU.

    ``fp16_supported`` left out is asked of this machine when a rule first reads it (it needs
    torch, which deepy.py imports only when a rule needs it)."""

    def __init__(self, cuda: bool, fp16_supported: bool | None = None) -> None:
        self.cuda = cuda
        self._fp16_supported = fp16_supported

    @property
    def fp16_supported(self) -> bool:
        if self._fp16_supported is None:
            self._fp16_supported = _fp16_supported_here(self.cuda)
        return self._fp16_supported

    @classmethod
    def detect(cls) -> Device:
        return cls(cuda=devices.gpu_count() > 0)

    def __repr__(self) -> str:
        return f"Device(cuda={self.cuda}, fp16_supported={self._fp16_supported})"


def _fp16_supported_here(cuda: bool) -> bool:
    # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for this CPU
    # ("Type fp16 is not supported on your device"), so ask the same question it will ask.
    if cuda:
        return True
    # lazy: torch; the launcher (deepy.py) reads this module without it
    from megatron import torch_internals

    try:
        return torch_internals.mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):
        return False


G = TypeVar("G", bound=BaseModel)


@dataclass
class RuleContext:
    """The arguments under check plus what the rules need to phrase their messages."""

    args: BaseModel
    """The validated arguments (``NeoXArgs``, a pydantic model composed of every group)."""
    provenance: Mapping[str, str] = field(default_factory=dict)
    world_size: int = 1
    device: Device = field(default_factory=lambda: Device(cuda=False, fp16_supported=False))
    warnings: list[str] = field(default_factory=list)
    """Things that are fine to launch with but worth saying (printed by deepy.py)."""
    skipped: list[str] = field(default_factory=list)
    """Checks not made here and why (``--dry-run`` lists them)."""
    entry_point: str | None = None
    """The script the ranks run (``deepy.py``'s USER_SCRIPT); None where no launch is planned (a config
    built in Python by a tool or test): the checks of what a run loads (``resume_checks.py``) need it."""

    @property
    def trains(self) -> bool:
        """The ranks train (any script but the inference ones), so they resume, save and follow a schedule."""
        return self.entry_point is not None and os.path.basename(self.entry_point) not in INFERENCE_ENTRY_POINTS

    def get(self, key: str) -> Any:
        return getattr(self.args, key)

    def group(self, cls: type[G]) -> G:
        """The arguments read as the component's own group ``cls``: ``NeoXArgs`` inherits every
        ArgGroup, so a check hands its component the typed group it declares. Not checked at run time
        (the honesty test's read recorder stands in for the arguments)."""
        return cast(G, self.args)

    def source(self, key: str) -> str:
        return self.provenance.get(key, DEFAULT)

    def given(self, key: str) -> bool:
        """Did the user set ``key`` (in a file or on the command line)?

        Keys with a non-``None`` default (``gradient_accumulation_steps: 1``) cannot be told apart by
        value alone, so provenance decides; without a provenance entry a value other than the
        schema default counts as given (tests and programmatic callers build args directly).
        """
        src = self.provenance.get(key)
        if src is not None:
            return src != DERIVED
        return self.get(key) != default_of(self.args, key)

    def show(self, key: str) -> str:
        """``key=value (file:line)`` as a message names a setting."""
        return f"{key}={render(self.get(key))} ({describe(self.source(key))})"

    @property
    def tp(self) -> int:
        return int(self.get("model_parallel_size") or 1)

    @property
    def pipe_parallel_size(self) -> int:
        """``pipe_parallel_size`` as validated (an int >= 0): 0 builds no PipelineModule, 1 a one-stage one."""
        value: int = self.get("pipe_parallel_size")
        return value

    @property
    def uses_pipeline_module(self) -> bool:
        """The model runs under DeepSpeed's PipelineEngine (``pipe_parallel_size >= 1``)."""
        return self.pipe_parallel_size >= 1

    @property
    def pp(self) -> int:
        """Pipeline stages; ``pipe_parallel_size: 0`` (no PipelineModule) is one stage."""
        return max(self.pipe_parallel_size, 1)

    @property
    def cp(self) -> int:
        """Context-parallel size: ranks sharing each sequence."""
        return int(self.get("context_parallel_size") or 1)

    @property
    def dp(self) -> int | None:
        """Data-parallel size (ranks reading different samples), or ``None`` when the world does not
        split into tp x pp x cp."""
        if self.world_size % (self.tp * self.pp * self.cp) != 0:
            return None
        return self.world_size // (self.tp * self.pp * self.cp)


def default_of(args: BaseModel, key: str) -> Any:
    """The schema default of ``key`` (None for a name the arguments do not declare)."""
    fields = getattr(type(args), "model_fields", {})  # the honesty test's read recorder wraps the model
    if key in fields:
        return fields[key].get_default(call_default_factory=True)
    return None


def describe(source: str) -> str:
    """A provenance as a message says it (``configs/125M.yml:12``, ``command line``, ``default``)."""
    return {CLI: "command line", DEFAULT: "default", DERIVED: "derived"}.get(source, source)


def render(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "unset"
    return str(value)


# --- shared readings of multi-spelling settings (several components' checks ask them) ------------
def block_enabled(block: Any) -> bool:
    """DeepSpeed reads ``fp16: {}`` as disabled and ``fp16: {enabled: true}`` as enabled."""
    return isinstance(block, Mapping) and bool(block.get("enabled", False))


def zero_stage(ctx: RuleContext) -> int:
    """The ZeRO stage DeepSpeed will use (``zero_optimization.stage`` after derivation)."""
    block = ctx.get("zero_optimization")
    if isinstance(block, Mapping) and isinstance(block.get("stage"), int):
        return int(block["stage"])
    stage = ctx.get("zero_stage")
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0


def zero_source(ctx: RuleContext) -> str:
    """Where the ZeRO stage was set, as a message names it."""
    if ctx.given("zero_stage"):
        return f"zero_stage at {describe(ctx.source('zero_stage'))}"
    return f"zero_optimization.stage at {describe(ctx.source('zero_optimization'))}"


Rule = Callable[[RuleContext], list[str]]
RULES: list[Rule] = []
R = TypeVar("R", bound=Rule)


def rule(fn: R) -> R:
    """Register ``fn`` as a rule; registration order is report order."""
    RULES.append(fn)
    return fn


def check(ctx: RuleContext, rules: list[Rule] | None = None) -> list[str]:
    """Every problem found by ``rules`` (default: all registered), in order."""
    problems: list[str] = []
    for fn in RULES if rules is None else rules:
        problems.extend(fn(ctx))
    return problems
