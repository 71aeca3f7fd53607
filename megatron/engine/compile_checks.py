"""What ``compile_layers`` needs from the machine: torch.compile's inductor builds native code.

On a GPU, Triton compiles a small C launcher for every kernel it generates (the C compiler named by
``CC``, else ``cc``/``gcc``/``clang`` on ``PATH``) against the interpreter's ``Python.h``; on a CPU,
inductor writes C++ (``CXX``, else ``g++``/``clang++``/``c++``). A node without them fails at the
first compiled forward with a long compiler traceback, after the model and the engine were built, so
it is said before launch when the ranks run on this machine, and by each rank before it builds its
model otherwise.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path

from megatron.config_rules import RuleContext, describe, rule
from megatron.errors import ConfigError
from megatron.launcher.checks import runs_on_this_machine

C_COMPILERS = ("cc", "gcc", "clang")
CXX_COMPILERS = ("g++", "clang++", "c++")


def toolchain_problems(cuda: bool, environ: Mapping[str, str] | None = None,
                       which: Callable[[str], str | None] | None = None,
                       include_dir: str | None = None) -> list[str]:
    """What is missing for torch.compile on a machine with (``cuda``) or without a GPU (this
    process's environment, ``PATH`` and interpreter unless given)."""
    environ = os.environ if environ is None else environ
    which = shutil.which if which is None else which
    variable, names = ("CC", C_COMPILERS) if cuda else ("CXX", CXX_COMPILERS)
    chosen = environ.get(variable)
    candidates = (chosen,) if chosen else names
    problems = []
    if not any(which(name) for name in candidates):
        what = "Triton's kernel launchers" if cuda else "inductor's C++ kernels"
        problems.append(f"no C{'' if cuda else '++'} compiler for {what} ({variable}={chosen!r} not found)"
                        if chosen else f"no C{'' if cuda else '++'} compiler for {what} (none of "
                        f"{', '.join(names)} on PATH; or name one in {variable})")
    if cuda:
        header = Path(include_dir or sysconfig.get_paths()["include"]) / "Python.h"
        if not header.is_file():
            problems.append(f"no {header} (the Python development headers Triton compiles against: "
                            f"python3-dev or your distribution's equivalent)")
    return problems


def _message(problems: list[str], where: str) -> str:
    return (f"compile_layers: true ({where}) needs a compiler toolchain on every node: "
            f"{'; '.join(problems)}. Install it, or set compile_layers: false")


@rule
def compile_layers_has_a_toolchain(ctx: RuleContext) -> list[str]:
    """Checked here when the ranks run on this machine (others: each rank checks its own node)."""
    if not ctx.get("compile_layers") or not runs_on_this_machine(ctx):
        return []
    problems = toolchain_problems(ctx.device.cuda)
    return [_message(problems, describe(ctx.source("compile_layers")))] if problems else []


def require_toolchain(cuda: bool) -> None:
    """On a rank, before its model is built: the same check, as one clear error."""
    problems = toolchain_problems(cuda)
    if problems:
        raise ConfigError(_message(problems, "the run's config"))
