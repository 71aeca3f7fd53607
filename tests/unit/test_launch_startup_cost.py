"""What keeps a launch's start-up short, and that each shortcut gives the answer the long way gives.

A launch on a 2-core CPU box cost about 8.5 s for half a second of training: deepy.py imported
torch (to count GPUs) and DeepSpeed (to ask its config parser), and every ZeRO rank imported
TorchInductor because DeepSpeed's Muon module wraps kernels in ``torch.compile`` at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- GPUs counted without torch where there is no driver -----------------------------------------
def test_no_gpu_driver_means_no_gpu_and_no_torch_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from megatron import devices

    monkeypatch.setattr(devices, "GPU_DRIVER_PATHS", (str(tmp_path / "absent"),))
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now raises
    assert devices.gpu_count() == 0


def test_with_a_driver_torch_is_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    from megatron import devices

    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(devices, "GPU_DRIVER_PATHS", (str(tmp_path / "nvidiactl"),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.gpu_count() == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.gpu_count() == 0  # a driver but no usable device (CUDA_VISIBLE_DEVICES="")


def test_the_shortcut_agrees_with_torch_on_this_machine() -> None:
    import torch

    from megatron.devices import gpu_count

    assert gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_levanter_require_accelerator_is_refused_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron import devices
    from megatron.neox_arguments.dialects import levanter_trainer

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    with pytest.raises(levanter_trainer.Refused, match="no GPU here"):
        levanter_trainer._require_accelerator(True, None)  # type: ignore[arg-type]
    levanter_trainer._require_accelerator(False, None)  # type: ignore[arg-type]


# --- DeepSpeed's answer on a config, remembered only when it accepts -----------------------------
ACCEPTED = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1}}
REFUSED = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 1, "reduce_bucket_size": "lots"}}


def test_an_accepted_config_is_remembered_and_not_asked_again(tmp_path: Path) -> None:
    code = f"""
import json, sys
from megatron.neox_arguments.deepspeed_split import accepted_config_marker, deepspeed_problems
config = json.loads({json.dumps(ACCEPTED)!r})
print(json.dumps([deepspeed_problems(config), accepted_config_marker(config).exists()]))
"""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first = json.loads(_python(code, env))
    assert first == [[], True]
    # the second process answers from the marker: DeepSpeed (and torch) are never imported
    second = json.loads(_python(code + "\nprint(json.dumps(['deepspeed' in sys.modules, 'torch' in sys.modules]))", env)
                        .splitlines()[-1])
    assert second == [False, False]


def test_a_refused_config_is_refused_every_time_and_never_remembered(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.neox_arguments.deepspeed_split import accepted_config_marker, deepspeed_problems

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for _ in range(2):
        problems = deepspeed_problems(REFUSED, {"zero_optimization": "model.yml:3"})
        assert problems and "reduce_bucket_size" in problems[0] and "model.yml:3" in problems[0]
    marker = accepted_config_marker(REFUSED)
    assert marker is not None and not marker.exists()


def test_the_marker_depends_on_the_config_and_can_be_turned_off(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.neox_arguments.deepspeed_split import accepted_config_marker

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stage2 = {**ACCEPTED, "zero_optimization": {"stage": 2}}
    assert accepted_config_marker(ACCEPTED) != accepted_config_marker(stage2)
    assert str(accepted_config_marker(ACCEPTED)).startswith(str(tmp_path))
    monkeypatch.setenv("DEEPY_NO_CACHE", "1")
    assert accepted_config_marker(ACCEPTED) is None


# --- deepy.py launches without importing torch ---------------------------------------------------
def test_resolving_and_planning_a_cpu_launch_imports_neither_torch_nor_deepspeed(tmp_path: Path) -> None:
    from megatron.devices import gpu_driver_present

    if gpu_driver_present():
        pytest.skip("a GPU driver is installed: deepy.py rightly asks torch for the device count")
    (tmp_path / "m.yml").write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n"
                                    "max_position_embeddings: 32\ntrain_batch_size: 8\ntrain_iters: 2\n"
                                    "use_dummy_dataset: true\ntokenizer_type: CharLevelTokenizer\n"
                                    "precision: fp32\nzero_optimization: {stage: 1}\nlr: 0.001\n")
    code = f"""
import sys
from megatron.app.deepy import check_memory, memory_fit, parse_command, plan_run, resolve
command = parse_command([{str(REPO / 'train.py')!r}, {str(tmp_path / 'm.yml')!r}])
resolved = resolve(command)
check_memory(resolved, memory_fit(resolved), command.user_script)  # the estimate against this machine
plan = plan_run(resolved, command.user_script, 'deepy_config.json')
print(plan.mode, plan.world_size, sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'deepspeed'}}))
"""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    # the first launch of a config asks DeepSpeed's parser; every later one is torch-free
    assert _python(code, env).splitlines()[-1] == "local 1 ['deepspeed', 'torch']"
    assert _python(code, env).splitlines()[-1] == "local 1 []"
