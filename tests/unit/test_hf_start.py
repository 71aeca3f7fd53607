"""initialize_from_hf: deepy.py converts the local HF model once, before launch, and the run starts from it
(megatron/interop/hf_start.py); the import tool itself is tested in tests/e2e/test_hf_interop.py."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.interop.hf_start import CONVERTED_MARKER, HfImport, start_from_hf


def _plan(tmp_path: Path, tp: int = 1) -> HfImport:
    return HfImport(str(tmp_path / "hf"), tmp_path / "ckpt", tp, 0, "bfloat16", 64)


def test_the_model_is_converted_once_at_the_runs_split_and_dtype(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def tool(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        (Path(argv[3]) / CONVERTED_MARKER).parent.mkdir(parents=True)
        (Path(argv[3]) / CONVERTED_MARKER).write_text("")
        return subprocess.CompletedProcess(argv, 0, "", "")

    plan = _plan(tmp_path, tp=2)
    assert "converted" in start_from_hf(plan, has_own_checkpoint=False, run=tool)
    target = str(tmp_path / "ckpt" / "hf_import")
    assert str(plan.target) == target
    assert calls[0][2:] == [str(tmp_path / "hf"), target, "--tp", "2", "--pp", "0", "--precision", "bf16",
                            "--seq-length", "64", "--no-verify"]
    # a second launch reuses the conversion; a restart with its own checkpoint does not read it
    assert "earlier launch" in start_from_hf(_plan(tmp_path), has_own_checkpoint=False, run=tool)
    assert "resumes its own checkpoint" in start_from_hf(_plan(tmp_path), has_own_checkpoint=True, run=tool)
    assert len(calls) == 1


def test_a_failed_conversion_stops_the_launch_with_its_output(tmp_path: Path) -> None:
    def failing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 2, "", "deepy: config error: LlamaForCausalLM: bad shape\n")

    with pytest.raises(ConfigError, match="converting .* failed:\ndeepy: config error: LlamaForCausalLM: bad shape"):
        start_from_hf(_plan(tmp_path), has_own_checkpoint=False, run=failing)
