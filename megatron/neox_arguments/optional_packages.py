"""Optional features name the package they need before launch (registered as a config rule).

A feature whose package is not installed (an optimizer from ``pytorch-optimizer``, lm-eval tasks, a
tiktoken or SentencePiece tokenizer, zstd-compressed raw text) would otherwise fail on every rank after
the model is built. The check looks the module up (``importlib.util.find_spec``, no import: lm-eval
takes seconds to import) with an injected finder so tests can simulate a missing package. W&B and
TensorBoard are checked with the trackers (``megatron/logging/preflight.py``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from megatron import plugins
from megatron.config_rules import RuleContext, rule
from megatron.engine.optimizer_block import OPTIMIZER_KINDS
from megatron.launcher.checks import runs_on_this_machine

Finder = Callable[[str], Any]

_OPTIMIZER_PACKAGE = {"lion": "Lion", "sm3": "SM3", "madgrad_wd": "madgrad_wd"}


def needed_packages(ctx: RuleContext) -> list[tuple[str, str, str]]:
    """(module, pip package, the setting that needs it) for this config's optional features."""
    needs: list[tuple[str, str, str]] = []
    block = ctx.get("optimizer")
    kind = block.kind if block is not None else OPTIMIZER_KINDS.get(str(ctx.get("optimizer_type")).lower())
    if kind in _OPTIMIZER_PACKAGE:
        setting = f"optimizer.type={block.type}" if block is not None else ctx.show("optimizer_type")
        needs.append(("pytorch_optimizer", "pytorch-optimizer", setting))
    if ctx.get("eval_tasks"):
        needs.append(("lm_eval", "lm-eval", ctx.show("eval_tasks")))
    tokenizer = plugins.find("tokenizer_type", str(ctx.get("tokenizer_type")))
    if tokenizer is not None and "package" in tokenizer.needs:  # the tokenizer plug-in names its library
        module, package = tokenizer.needs["package"]
        needs.append((module, package, ctx.show("tokenizer_type")))
    for key in ("train_urls", "validation_urls"):
        if any(str(url).endswith(".zst") for url in ctx.get(key) or []):
            needs.append(("zstandard", "zstandard", f"{key} (.zst files)"))
    if ctx.get("tokenize_ray_address") is not None:
        needs.append(("ray", "ray", ctx.show("tokenize_ray_address")))
    return needs


def missing_package_problems(ctx: RuleContext, find_spec: Finder | None = None) -> list[str]:
    find = find_spec or importlib.util.find_spec
    problems = []
    for module, package, setting in needed_packages(ctx):
        if find(module) is not None:
            continue
        message = (f"{setting} needs the '{package}' package, which is not installed here: "
                   f"pip install {package} (or pip install -r requirements/requirements.txt)")
        if runs_on_this_machine(ctx):
            problems.append(message)
        else:
            ctx.warnings.append(f"{message}; the ranks run on other machines and need it there")
    return problems


@rule
def optional_packages_installed(ctx: RuleContext) -> list[str]:
    return missing_package_problems(ctx)
