"""initialize_from_hf: deepy.py converts the local HF model once, before launch, and the run starts from it
(megatron/interop/hf_start.py); the import tool itself is tested in tests/e2e/test_hf_interop.py."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.interop.hf_start import CONVERTED_MARKER, start_from_hf
from megatron.neox_arguments import NeoXArgs


def test_the_model_is_converted_once_at_the_runs_split_and_dtype(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def tool(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        (Path(argv[3]) / CONVERTED_MARKER).parent.mkdir(parents=True)
        (Path(argv[3]) / CONVERTED_MARKER).write_text("")
        return subprocess.CompletedProcess(argv, 0, "", "")

    args = NeoXArgs(initialize_from_hf=str(tmp_path / "hf"), save=str(tmp_path / "ckpt"), model_parallel_size=2,
                    pipe_parallel_size=0, precision="bfloat16", seq_length=64)
    provenance: dict[str, str] = {}
    assert "converted" in str(start_from_hf(args, provenance, has_own_checkpoint=False, run=tool))
    target = str(tmp_path / "ckpt" / "hf_import")
    assert args.initialize_from == target and "initialize_from_hf" in provenance["initialize_from"]
    assert calls[0][2:] == [str(tmp_path / "hf"), target, "--tp", "2", "--pp", "0", "--precision", "bf16",
                            "--seq-length", "64", "--no-verify"]
    # a second launch reuses the conversion; a restart with its own checkpoint does not read it, but keeps
    # initialize_from (the checkpoint recorded it: the restart is the same run)
    for own in (False, True):
        again = NeoXArgs(initialize_from_hf=str(tmp_path / "hf"), save=str(tmp_path / "ckpt"))
        start_from_hf(again, {}, has_own_checkpoint=own, run=tool)
        assert again.initialize_from == target
    assert len(calls) == 1
    assert start_from_hf(NeoXArgs(), {}, has_own_checkpoint=False, run=tool) is None


def test_a_failed_conversion_stops_the_launch_with_its_output(tmp_path: Path) -> None:
    def failing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 2, "", "deepy: config error: LlamaForCausalLM: bad shape\n")

    args = NeoXArgs(initialize_from_hf=str(tmp_path / "hf"), save=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match="converting .* failed:\ndeepy: config error: LlamaForCausalLM: bad shape"):
        start_from_hf(args, {}, has_own_checkpoint=False, run=failing)
