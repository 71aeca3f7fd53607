"""An optional feature's missing package is refused before launch, naming the package."""

from __future__ import annotations

from typing import Any

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments import config_from_mapping, finalize
from megatron.neox_arguments.optional_packages import missing_package_problems
from megatron.config_rules import Device, RuleContext

BASE: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
                        "train_micro_batch_size_per_gpu": 2, "train_iters": 4, "use_dummy_dataset": True,
                        "tokenizer_type": "CharLevelTokenizer"}


def _absent(*modules: str):  # noqa: ANN202
    import importlib.util

    return lambda name: None if name in modules else importlib.util.find_spec(name)


@pytest.mark.parametrize(("values", "module", "package"), [
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-3}}}, "pytorch_optimizer", "pytorch-optimizer"),
    ({"optimizer_type": "sm3", "lr": 1e-3}, "pytorch_optimizer", "pytorch-optimizer"),
    ({"lr": 1e-3, "eval_tasks": ["lambada_openai"]}, "lm_eval", "lm-eval"),
    ({"lr": 1e-3, "use_dummy_dataset": False, "train_urls": ["data/part-0.jsonl.zst"]}, "zstandard", "zstandard"),
])  # fmt: skip
def test_missing_package_is_named(values: dict[str, Any], module: str, package: str) -> None:
    args = config_from_mapping({**BASE, **values}).args
    problems = missing_package_problems(RuleContext(args=args), find_spec=_absent(module))
    assert len(problems) == 1 and f"needs the '{package}' package" in problems[0], problems
    assert f"pip install {package}" in problems[0]
    assert missing_package_problems(RuleContext(args=args), find_spec=_absent("nothing")) == []


def test_the_rule_runs_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytorch_optimizer" else real(name, *a))
    with pytest.raises(ConfigError, match="optimizer.type=Lion needs the 'pytorch-optimizer' package"):
        finalize(config_from_mapping({**BASE, "optimizer": {"type": "Lion", "params": {"lr": 1e-3}}}), 1,
                 device=Device(cuda=False, fp16_supported=False))
