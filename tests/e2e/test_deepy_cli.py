"""``deepy.py`` end to end: ``--dry-run`` output, and every user mistake -> one message, exit code 2.

Most error cases run ``main`` in-process under ``run_guarded`` (the same code path as the script, but
without paying ~1-3 s of interpreter start-up each); a few real subprocesses prove the script itself
exits 2 without a traceback, and shows one with ``--debug``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.app.deepy import main, parse_command
from megatron.errors import run_guarded

REPO = Path(__file__).resolve().parents[2]
DEEPY = str(REPO / "deepy.py")


@pytest.fixture()
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory with a user script and a small valid model config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('worker')\n")
    (tmp_path / "model.yml").write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nmax_position_embeddings: 32\n"
        "train_micro_batch_size_per_gpu: 2\nlr: 0.001\nuse_dummy_dataset: true\ntokenizer_type: CharLevelTokenizer\n"
    )
    return tmp_path


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        run_guarded(lambda: main(argv), argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def run_script(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DEEPY_DEBUG", None)
    return subprocess.run(
        [sys.executable, DEEPY, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


# (files to write, argv after "--dry-run", text the one error message must contain)
ERROR_CASES = {
    "malformed_yaml": ({"bad.yml": "num_layers: 2\nhidden_size: {64\n"}, ["train.py", "bad.yml"],
                       ["config error: bad.yml:3:1: malformed YAML"]),
    "unknown_key": ({"u.yml": "num_layer: 2\n"}, ["train.py", "u.yml"],
                    ["unknown key 'num_layer' at u.yml:1; did you mean: num_layers"]),
    "duplicate_same_file": ({"d.yml": "seq_length: 1\nseq_length: 2\n"}, ["train.py", "d.yml"],
                            ["duplicate key 'seq_length'", "d.yml:1", "d.yml:2"]),
    "duplicate_two_files": ({}, ["train.py", "model.yml", "again.yml"],
                            ["key 'hidden_size' is set twice", "model.yml:2", "again.yml:1"]),
    "duplicate_spellings": ({"s.yml": "train-iters: 1\ntrain_iters: 2\n"}, ["train.py", "s.yml"],
                            ["'train-iters' at s.yml:1 and 'train_iters' at s.yml:2"]),
    "wrong_type": ({"t.yml": "num_layers: lots\n"}, ["train.py", "t.yml"],
                   ["num_layers = 'lots' at t.yml:1: expected int"]),
    "bad_value": ({"v.yml": "precision: fp12\n"}, ["train.py", "v.yml"],
                  ["precision = 'fp12' at v.yml:1: expected 'fp16' | 'fp32' | 'bfloat16'"]),
    "python_tag": ({"p.yml": "num_layers: !!python/object/apply:os.getcwd []\n"}, ["train.py", "p.yml"],
                   ["p.yml:1:13", "safe YAML only"]),
    "missing_config": ({}, ["train.py", "model.yml", "nope"],
                       ["config file not found: nope (looked for nope, nope.yml"]),
    "missing_script": ({}, ["nothere.py", "model.yml"], ["usage error: user script not found: nothere.py"]),
    "no_config": ({}, ["train.py"], ["usage error: no config file given after train.py"]),
    "override_without_value": ({}, ["train.py", "model.yml", "a=1", "foo"], ["bad override 'foo': write key=value"]),
    "override_without_key": ({}, ["train.py", "model.yml", "=3"], ["bad override '=3': the key before '=' is missing"]),
    "override_unknown_key": ({}, ["train.py", "model.yml", "hiden_size=3"],
                             ["unknown key 'hiden_size' at command-line override 'hiden_size=3'"]),
    "override_bad_yaml": ({}, ["train.py", "model.yml", "num_layers=[1"], ["override 'num_layers=[1':1:", "malformed YAML"]),
    "missing_key": ({"m.yml": "lr: 0.1\ntrain_micro_batch_size_per_gpu: 1\nuse_dummy_dataset: true\n"},
                    ["train.py", "m.yml"], ["num_layers", "not set"]),
    "bad_combination": ({}, ["train.py", "model.yml", "num_attention_heads=5"], ["num_attention_heads", "5", "hidden_size"]),
    "obsolete": ({"x.yml": "sparsity_config: {block: 16}\n"}, ["train.py", "model.yml", "x.yml"],
                 ["is obsolete", "sparsity_config", "DeepSpeed 0.19.8", "x.yml:1"]),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_user_mistakes_exit_2_with_one_message(case: str, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files, argv, expected = ERROR_CASES[case]
    (work / "again.yml").write_text("hidden_size: 32\n")
    for name, text in files.items():
        (work / name).write_text(text)
    code, out, err = run_in_process(["--dry-run", *argv], capsys)
    assert code == 2, (out, err)
    assert err.startswith("deepy: "), err
    for text in expected:
        assert text in err, err
    # nothing of deepy's own on stdout (DeepSpeed may log its accelerator choice there on first import)
    assert "Traceback" not in err + out and "deepy:" not in out


def test_command_line_shape(work: Path) -> None:
    command = parse_command(["-d", "confs", "train.py", "a", "b.yml", "x=1", "y.z=2", "--dry-run"])
    assert command.config_files == ["a", "b.yml"] and command.overrides == ["x=1", "y.z=2"]
    assert command.conf_dir == "confs" and command.dry_run and command.user_script == "train.py"


def test_script_exits_2_without_traceback_and_debug_shows_it(work: Path) -> None:
    (work / "u.yml").write_text("num_layers: 2\nhiden_size: 3\n")
    plain = run_script("--dry-run", "train.py", "u.yml", cwd=work)
    assert plain.returncode == 2
    assert plain.stderr.startswith("deepy: config error: unknown key 'hiden_size' at u.yml:2; did you mean: hidden_size")
    assert plain.stderr.count("\n") == 1 and plain.stdout == ""  # one message, nothing else
    debug = run_script("--debug", "--dry-run", "train.py", "u.yml", cwd=work)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
    missing = run_script("--dry-run", "nothere.py", "u.yml", cwd=work)
    assert missing.returncode == 2 and "user script not found: nothere.py" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_dry_run_prints_provenance_and_deepspeed_config(tmp_path: Path, local_setup_dir: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a dry run must not start the user script')\n")
    result = run_script(
        "--dry-run", str(script), "configs/125M.yml", "configs/local_setup.yml", "train_iters=123",
        "optimizer.params.lr=3e-4", cwd=local_setup_dir,  # data/ and configs/ as local_setup.yml names them
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    def row(key: str) -> str:
        found = [line for line in lines if line.split()[:1] == [key]]
        assert len(found) == 1, (key, result.stdout)
        return found[0]

    assert row("hidden_size").split()[1:] == ["768", f"configs/125M.yml:{line_of('configs/125M.yml', 'hidden_size')}"]
    assert row("data_path").endswith(f"configs/local_setup.yml:{line_of('configs/local_setup.yml', 'data_path')}")
    assert row("train_iters").split()[1:] == ["123", "cli"]
    assert row("optimizer.params.lr").split()[1:] == ["0.0003", "cli"]
    assert row("train_batch_size").split()[-1] == "derived"
    assert "DeepSpeed config:" in result.stdout and '"train_batch_size"' in result.stdout
    assert result.stdout.rstrip().endswith("deepy: dry run OK, nothing launched")
    run_dir = [line for line in lines if line.startswith("Run directory: ")][0].split()[2]
    assert not (local_setup_dir / run_dir).exists()


def line_of(path: str, key: str) -> int:
    """1-based line of the first line of ``path`` that sets ``key``."""
    for number, line in enumerate((REPO / path).read_text().splitlines(), start=1):
        if line.strip().lstrip('"').startswith(key + '"') or line.strip().startswith(key + ":"):
            return number
    raise AssertionError(f"{key} not in {path}")


def test_real_launch_writes_the_resolved_file_and_returns_the_launcher_code(
    work: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import megatron.launcher
    import megatron.launcher.restarts

    from megatron.neox_arguments.resolved import load_resolved

    calls: list[tuple[str, str]] = []

    def fake_run(plan: megatron.launcher.LaunchPlan, replan: object, environ: object, policy: object,
                 **_said: object) -> int:
        calls.append((plan.argv[-3], plan.config_path))
        assert Path(plan.config_path).is_file()  # written before any rank could start
        return 3

    monkeypatch.setattr(megatron.launcher.restarts, "run_with_restarts", fake_run)
    code, out, err = run_in_process(["train.py", "model.yml", "log_dir=mylogs", "train_iters=4"], capsys)
    assert code == 3, err  # a failed rank's exit code is deepy's exit code
    [(script, config_file)] = calls
    assert script == "train.py"
    run_dir = Path(config_file).parent
    assert run_dir.parent == Path("mylogs") and Path(config_file).name == "deepy_config.json"
    assert f"resolved config written to {config_file}" in out
    back = load_resolved(config_file)
    assert back.directory == str(run_dir) and back.args.train_iters == 4
    assert back.run_name == run_dir.name  # the ranks name the run after its directory: metrics go there too
    assert back.provenance["num_layers"] == "model.yml:1" and back.provenance["train_iters"] == "cli"
    assert back.deepspeed_config is not None and back.deepspeed_config["train_batch_size"] >= 1
    assert back.config_files == {"model.yml": (work / "model.yml").read_text()}


def test_dry_run_says_what_is_ignored_or_refused_and_why(tmp_path: Path, local_setup_dir: Path) -> None:
    """Keys that change nothing on this run are listed with the reason; a DeepSpeed block that cannot take
    effect on this layout is refused (exit 2) with the reason."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a dry run must not start the user script')\n")
    base = ("--dry-run", str(script), "configs/tiny.yml", "configs/local_setup.yml")
    said = run_script(*base, "synchronize_each_layer=true", "scaled_masked_softmax_fusion=true", cwd=local_setup_dir)
    assert said.returncode == 0, said.stderr
    assert "ignored: synchronize_each_layer=True (command line): no activations are checkpointed" in said.stdout
    assert "no effect here: scaled_masked_softmax_fusion (selects a fused kernel" in said.stdout
    refused = run_script(*base, "flops_profiler.enabled=true", cwd=local_setup_dir)  # tiny.yml: pipe_parallel_size 1
    assert refused.returncode == 2 and "pipeline engine never prints the profile" in refused.stderr + refused.stdout
