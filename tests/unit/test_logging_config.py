"""The logging component's config: both tracker spellings, the pre-launch checks, and deepy.py's
refusal (exit 2) when a tracker's package cannot be imported."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from megatron.errors import ConfigError
from megatron.logging.config import LoggingArgs, TensorboardSettings, TrackerSettings, WandbSettings
from megatron.logging.preflight import logging_problems
from megatron.neox_arguments.arguments import NeoXArgs, check_supported
from megatron.config_rules import Device, RuleContext
from megatron.logging.preflight import trackers_and_profiling
from megatron.neox_arguments.rules import memory_snapshot_needs_a_gpu

REPO = Path(__file__).resolve().parents[2]
GPU = Device(cuda=True, fp16_supported=True)
CPU = Device(cuda=False, fp16_supported=False)


def _problems(ctx: RuleContext,
              import_module: Callable[[str], ModuleType] = importlib.import_module) -> list[str]:
    """The logging checks of ``ctx``'s config with an injected importer."""
    return logging_problems(ctx.args, ctx.show, import_module=import_module)


def _tracker(cfg: LoggingArgs, kind: str) -> TrackerSettings:
    (found,) = [t for t in cfg.tracker_settings() if t.type == kind]
    return found


def test_gpt_neox_keys() -> None:
    cfg = NeoXArgs(
        log_dir="logs", use_wandb=True, wandb_project="proj", wandb_group="g", wandb_run_name="run1",
        wandb_team="team", wandb_host="https://wandb.example", tensorboard_dir="tb", log_interval=7,
    )  # fmt: skip
    assert [t.type for t in cfg.tracker_settings()] == ["jsonl", "wandb", "tensorboard"]
    wandb = _tracker(cfg, "wandb")
    assert isinstance(wandb, WandbSettings)
    assert (wandb.project, wandb.group, wandb.name, wandb.entity, wandb.host) == (
        "proj", "g", "run1", "team", "https://wandb.example")
    assert _tracker(cfg, "tensorboard") == TensorboardSettings(logdir="tb", source="tensorboard_dir")
    assert cfg.log_interval == 7
    # the profiler writes into the TensorBoard directory
    assert cfg.profile_settings().trace_dir == "tb"


def test_nothing_asked_nothing_tracked() -> None:
    assert NeoXArgs().tracker_settings() == ()  # no log_dir: not even metrics.jsonl; use_wandb unset means off
    assert NeoXArgs(use_wandb=False, log_dir="x").tracker_settings()[0].type == "jsonl"


def test_levanter_tracker_block_single_and_list() -> None:
    one = NeoXArgs(tracker={"type": "wandb", "project": "lev", "tags": ["a"]}, wandb_team="team")
    (wandb,) = one.tracker_settings()
    assert isinstance(wandb, WandbSettings)
    assert (wandb.project, wandb.entity, wandb.tags, wandb.source) == ("lev", "team", ("a",), "tracker")
    both = NeoXArgs(log_dir="logs", tracker=[
        {"type": "wandb", "project": "p", "mode": "offline"}, {"type": "tensorboard"}])
    assert [t.type for t in both.tracker_settings()] == ["jsonl", "wandb", "tensorboard"]
    assert _tracker(both, "wandb").mode == "offline"  # type: ignore[union-attr]
    assert _tracker(both, "tensorboard").logdir == "logs/tensorboard"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "comet", "project": "p"},  # not a tracker type
        {"type": "wandb", "projct": "p"},  # misspelt field
        {"type": "wandb", "mode": "sometimes"},
        {"project": "p"},  # no type to discriminate on
        [{"type": "tensorboard", "logdir": 3}],
    ],
)
def test_tracker_block_is_validated(bad: Any) -> None:
    with pytest.raises(ValidationError, match="tracker"):
        NeoXArgs(tracker=bad)


def test_the_tracker_key_round_trips_through_the_resolved_config() -> None:
    args = NeoXArgs(tracker=[{"type": "wandb", "project": "p"}, {"type": "tensorboard", "logdir": "tb"}])
    again = NeoXArgs(**args.model_dump(mode="json"))
    assert again.tracker_settings() == args.tracker_settings()
    assert check_supported(args) == []


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"use_wandb": True, "tracker": {"type": "wandb"}}, "W&B is configured twice"),
        ({"tensorboard_dir": "a", "tracker": {"type": "tensorboard", "logdir": "b"}}, "TensorBoard is configured twice"),
        ({"tracker": [{"type": "tensorboard"}, {"type": "tensorboard"}]}, "type 'tensorboard' 2 times"),
    ],
)
def test_one_spelling_per_tracker(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NeoXArgs(**values).tracker_settings()
    assert any(match in p for p in trackers_and_profiling(RuleContext(NeoXArgs(**values))))


def _missing(*names: str) -> Any:
    def import_module(name: str) -> ModuleType:
        if name.split(".")[0] in names or name in names:
            raise ImportError(f"No module named {name!r}")
        return importlib.import_module(name)

    return import_module


def test_missing_tracker_package_is_named_before_launch() -> None:
    ctx = RuleContext(NeoXArgs(use_wandb=True, tensorboard_dir="tb"), provenance={"use_wandb": "run.yml:3"})
    problems = _problems(ctx, import_module=_missing("wandb"))
    assert len(problems) == 1
    assert "use_wandb=True (run.yml:3)" in problems[0] and "it pins wandb" in problems[0]
    tb = _problems(ctx, import_module=_missing("torch.utils.tensorboard"))
    assert len(tb) == 1 and "tensorboard_dir='tb'" in tb[0] and "'tensorboard' package" in tb[0]
    assert _problems(ctx) == []  # both are installed here


def test_profiling_checks() -> None:
    memory = dict(memory_profiling=True, profile_step_start=3, profile_step_stop=5)
    cpu = RuleContext(NeoXArgs(**memory), device=CPU)
    assert _problems(cpu) == []  # the ranges are right; the device is the rule below's business
    assert any("no GPU" in p for p in memory_snapshot_needs_a_gpu(cpu))
    # launching elsewhere (a login node, here several nodes): this machine's devices say nothing
    assert memory_snapshot_needs_a_gpu(RuleContext(NeoXArgs(**memory, num_nodes=2), device=CPU)) == []
    gpu = RuleContext(NeoXArgs(**memory), device=GPU)
    assert _problems(gpu) == [] and memory_snapshot_needs_a_gpu(gpu) == []
    backwards = RuleContext(NeoXArgs(profile=True, profile_step_start=5, profile_step_stop=5))
    assert any("stop step must come after" in p for p in _problems(backwards))


def run_deepy(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from megatron.app.deepy import main
    from megatron.errors import run_guarded

    with pytest.raises(SystemExit) as done:
        run_guarded(lambda: main(argv), argv=argv)
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out + captured.err


MODEL = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
max_position_embeddings: 32
optimizer: {type: Adam, params: {lr: 0.001}}
train_batch_size: 4
train_iters: 4
num_gpus: 1
use_dummy_dataset: true
tokenizer_type: CharLevelTokenizer
"""


def test_deepy_refuses_a_tracker_whose_package_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yml"
    config.write_text(MODEL + "use_wandb: true\n")
    # an import of wandb now fails exactly as it does where the package is not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 2, out
    assert f"use_wandb=True ({config}:12)" in out and "'wandb' package cannot be imported" in out
    assert "Traceback" not in out
    monkeypatch.delitem(sys.modules, "wandb")
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 0, out


def test_dry_run_shows_the_memory_estimate_and_debug_turns_deepspeed_info_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yml"
    config.write_text(MODEL + "device_memory_gb: 0.001\n")
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 2 and "exceeds the device's 0.0 GiB (device_memory_gb)" in out, out  # refused (issue 42)
    config.write_text(MODEL + "device_memory_gb: 0.001\nallow_memory_overcommit: true\n")
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 0, out
    assert "Memory estimate per device (tp=1 pp=1 dp=1, ZeRO-0, fp32" in out
    assert "WARNING: the estimate exceeds the device's 0.0 GiB (device_memory_gb)" in out
    assert "deepspeed_log_level" not in out  # at its default: DeepSpeed's INFO lines stay hidden
    code, out = run_deepy(["--dry-run", "--debug", str(REPO / "train.py"), str(config)], capsys)
    assert code == 0, out
    assert re.search(r'^deepspeed_log_level\s+"info"\s+cli$', out, re.MULTILINE), out


def test_wandb_code_dir_is_an_existing_directory_made_absolute_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yml"
    config.write_text(MODEL + "use_wandb: true\nwandb_code_dir: missing\n")
    monkeypatch.chdir(tmp_path)  # a relative directory is one of the launching directory
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 2, out
    assert f"wandb_code_dir='{tmp_path}/missing' ({config}:13) is not a directory" in out
    assert "Traceback" not in out
    (tmp_path / "missing").mkdir()
    code, out = run_deepy(["--dry-run", str(REPO / "train.py"), str(config)], capsys)
    assert code == 0, out
    assert re.search(rf'^wandb_code_dir\s+"{tmp_path}/missing"\s+{config}:13$', out, re.MULTILINE), out
    # a directory with no W&B run to save it with is a key without effect: refused
    alone = RuleContext(NeoXArgs(wandb_code_dir=str(tmp_path)), provenance={"wandb_code_dir": "run.yml:2"})
    (problem,) = _problems(alone)
    assert f"wandb_code_dir='{tmp_path}' (run.yml:2)" in problem and "no W&B run is asked for" in problem
