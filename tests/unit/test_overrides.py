"""``key=value`` overrides: parsing, dotted paths, precedence over files, provenance, and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.overrides import apply_overrides, parse_override, parse_overrides


@pytest.fixture()
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yml").write_text(
        "num_layers: 2\nhidden_size: 64\noptimizer:\n  type: Adam\n  params:\n    lr: 0.001\n    betas: [0.9, 0.95]\n"
    )
    return "m.yml"


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    return info.value.message


def test_values_are_parsed_as_yaml() -> None:
    assert parse_override("lr=3e-4").value == pytest.approx(3e-4)
    assert parse_override("train_iters=100").value == 100
    assert parse_override("use_wandb=false").value is False
    assert parse_override("log_dir=null").value is None
    assert parse_override("log_dir=").value is None
    assert parse_override("attention_config=[[[global], 2]]").value == [[["global"], 2]]
    assert parse_override("zero_optimization={stage: 1, cpu_offload: false}").value == {"stage": 1, "cpu_offload": False}
    assert parse_override("data_path=a=b").value == "a=b"  # only the first '=' separates


def test_dashes_in_the_argument_name_mean_underscores_but_sub_keys_are_kept() -> None:
    override = parse_override("zero-optimization.reduce-bucket-size=5")
    assert override.path == ("zero_optimization", "reduce-bucket-size")


def test_bad_override_syntax() -> None:
    assert error_of("foo") == "bad override 'foo': write key=value, e.g. train_iters=100"
    assert "the key before '=' is missing" in error_of("=3")
    assert "'a b' is not a key" in error_of("a b=1")
    assert "'a..b' is not a key" in error_of("a..b=1")
    message = error_of("lr=[1, 2")
    assert message.startswith("override 'lr=[1, 2':1:") and "malformed YAML" in message
    assert "safe YAML only" in error_of("lr=!!python/object/apply:os.system [ls]")


def test_same_override_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="override 'train_iters' given twice on the command line: 'train-iters=1' and 'train_iters=2'"):
        parse_overrides(["train-iters=1", "train_iters=2"])


def test_overrides_win_over_files_and_record_cli(model_file: str) -> None:
    resolved = load_config([model_file], ["hidden_size=128", "train_iters=5"])
    assert resolved.args.hidden_size == 128 and resolved.args.train_iters == 5
    assert resolved.provenance["hidden_size"] == "cli" and resolved.provenance["train_iters"] == "cli"
    assert resolved.provenance["num_layers"] == "m.yml:1"


def test_dotted_override_reaches_into_a_dict_from_a_file(model_file: str) -> None:
    resolved = load_config([model_file], ["optimizer.params.lr=3e-4"])
    block = resolved.args.optimizer
    assert block.type == "Adam" and block.params.lr == pytest.approx(3e-4) and block.params.betas == (0.9, 0.95)
    assert resolved.provenance["optimizer"] == "m.yml:3"  # the rest of the dict still comes from the file
    assert resolved.provenance["optimizer.params.lr"] == "cli"


def test_dotted_override_creates_missing_levels_of_an_unset_dict(model_file: str) -> None:
    resolved = load_config([model_file], ["zero_optimization.stage=1"])
    assert resolved.args.zero_optimization["stage"] == 1
    assert resolved.provenance["zero_optimization"] == "cli"


def test_whole_value_override_after_a_dotted_one_forgets_the_sub_key(model_file: str) -> None:
    values: dict = {"optimizer": {"type": "Adam"}}
    provenance = {"optimizer": "m.yml:3"}
    apply_overrides(values, provenance, parse_overrides(["optimizer.type=SGD", "optimizer={type: Lion}"]),
                    ["optimizer"], lambda key: None)
    assert values == {"optimizer": {"type": "Lion"}} and provenance == {"optimizer": "cli"}


def test_unknown_override_key_suggests_names(model_file: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([model_file], ["hiden_size=3"])
    assert info.value.message.startswith(
        "unknown key 'hiden_size' at command-line override 'hiden_size=3'; did you mean: hidden_size"
    )


def test_dotted_override_into_a_non_dict_is_an_error(model_file: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([model_file], ["num_layers.x=1"])
    assert "'num_layers' is 2 (from m.yml:1), not a dict" in info.value.message
    with pytest.raises(ConfigError, match="'optimizer.type' is 'Adam' \\(from m.yml:3\\), not a dict"):
        load_config([model_file], ["optimizer.type.x=1"])


def test_override_with_wrong_type_names_the_command_line(model_file: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([model_file], ["num_layers=many"])
    assert "num_layers = 'many' at the command line: expected int" in info.value.message


# --- the command line wins over a file's other spelling of the same setting (issue 42 item 16) ----------------
REPO = Path(__file__).resolve().parents[2]
RUNNABLE = ("use_dummy_dataset=true", "tokenizer_type=CharLevelTokenizer", "checkpoint_factor=null")
"""configs/tiny.yml with no data files, tokenizer or checkpoints to find (the overrides under test come after)."""


def tiny_dry_run(tmp: Path, *overrides: str, files: tuple[Path, ...] = ()):  # noqa: ANN201 - the resolved config
    """``deepy.py --dry-run train.py configs/tiny.yml [files] <overrides>``: every check before launch."""
    from megatron.app.deepy import parse_command, resolve

    return resolve(parse_command(["--dry-run", str(REPO / "train.py"), str(REPO / "configs" / "tiny.yml"),
                                  *map(str, files), *RUNNABLE, *overrides]))


def replaced_said(resolved, shown: str) -> bool:  # noqa: ANN001
    return any(w.startswith(shown) and "from the command line: overrides win over the config files" in w
               for w in resolved.warnings)


def test_lr_on_the_command_line_wins_over_the_files_optimizer_params_lr(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README: "key=value overrides come after the config files and win over them". configs/tiny.yml sets
    optimizer.params.lr 0.003 (line 24); ``lr=0.01`` was refused as a disagreement. Now the run's peak rate, what
    the optimizer and the schedule read (``peak_lr``), is 0.01, and the dry run says the file's value is replaced."""
    from megatron.neox_arguments.run_config import RunConfig

    monkeypatch.chdir(tmp_path)
    resolved = tiny_dry_run(tmp_path, "lr=0.01")
    assert RunConfig.from_resolved(resolved).optimizer_config.peak_lr == 0.01
    assert resolved.args.optimizer.params.lr is None and resolved.provenance["lr"] == "cli"
    assert replaced_said(resolved, "optimizer.params.lr=0.003 (") and "tiny.yml:24" in " ".join(resolved.warnings)
    # the other way round: the block's spelling on the command line, the flat key in a file
    flat = tmp_path / "flat.yml"
    flat.write_text("lr: 0.003\n")
    resolved = tiny_dry_run(tmp_path, "optimizer.params.lr=0.02", "optimizer.params.weight_decay=0.2",
                            files=(flat,))  # fmt: skip
    run = RunConfig.from_resolved(resolved)  # tiny.yml's flat weight_decay 0.0 (line 36) is replaced too
    assert (run.optimizer_config.peak_lr, run.optimizer_config.applied_weight_decay) == (0.02, 0.2)
    assert "lr" not in resolved.provenance and replaced_said(resolved, "lr=0.003 (")
    assert replaced_said(resolved, "weight_decay=0.0 (")
    # spellings that disagree within the files, or both on the command line, are still refused, naming both
    flat.write_text("lr: 0.01\n")
    with pytest.raises(ConfigError, match=r"lr=0.01 \(.*flat.yml:1\) and optimizer.params.lr=0.003 .* disagree"):
        tiny_dry_run(tmp_path, files=(flat,))
    with pytest.raises(ConfigError, match=r"lr=0.01 \(command line\) and optimizer.params.lr=0.02 .* disagree"):
        tiny_dry_run(tmp_path, "lr=0.01", "optimizer.params.lr=0.02")


def test_the_command_line_wins_over_every_other_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """weight_decay, the gradient clip (apex's optimizer.params.max_grad_norm, Megatron's clip_grad), the micro
    batch (GPT-NeoX's batch_size alias) and the precision (``precision`` or which fp16/bf16 block is enabled)."""
    from megatron.neox_arguments.run_config import RunConfig

    monkeypatch.chdir(tmp_path)
    spelled = tmp_path / "spelled.yml"
    spelled.write_text("batch_size: 8\nclip_grad: 1.0\n")
    resolved = tiny_dry_run(tmp_path, "weight_decay=0.3", "optimizer.params.max_grad_norm=0.25",
                            "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=1", files=(spelled,))
    assert RunConfig.from_resolved(resolved).optimizer_config.applied_weight_decay == 0.3
    assert resolved.deepspeed_config["gradient_clipping"] == 0.25
    assert resolved.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
    assert replaced_said(resolved, "clip_grad=1.0 (") and replaced_said(resolved, "batch_size=8 (")
    # tiny.yml says precision fp32 (line 41): the bf16 block on the command line wins; and back
    resolved = tiny_dry_run(tmp_path, "bf16.enabled=true")
    assert resolved.args.precision == "bfloat16" and resolved.deepspeed_config["bf16"]["enabled"] is True
    assert replaced_said(resolved, "precision='fp32' (")
    bf16 = tmp_path / "bf16.yml"
    bf16.write_text("bf16: {enabled: true}\n")
    without_precision = tmp_path / "tiny.yml"
    without_precision.write_text("\n".join(line for line in (REPO / "configs" / "tiny.yml").read_text().splitlines()
                                           if '"precision"' not in line))
    from megatron.app.deepy import parse_command, resolve

    resolved = resolve(parse_command(["--dry-run", str(REPO / "train.py"), str(without_precision), str(bf16),
                                      *RUNNABLE, "precision=fp32"]))
    assert resolved.args.precision == "fp32" and not resolved.deepspeed_config.get("bf16", {}).get("enabled")
    assert replaced_said(resolved, "bf16.enabled=True (")


# --- another trainer's name for a key: answered by meaning --------------------------------------------------
def test_other_trainers_names_are_answered_by_meaning(model_file: str) -> None:
    """Hugging Face's ``learning_rate=1e-3`` got "did you mean: sharding_strategy?" (spelling); now the key that
    means it. Every name of the table leads to a Deepy key, and none of them is a Deepy key itself."""
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.keys import OTHER_TRAINERS_NAMES

    expected = {"learning_rate": "lr", "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
                "num_train_epochs": "train_epochs", "max_steps": "train_iters", "warmup_steps": "warmup",
                "warmup_ratio": "warmup", "max_grad_norm": "gradient_clipping", "num_train_steps": "train_iters",
                "micro_batch_size": "train_micro_batch_size_per_gpu", "global_batch_size": "train_batch_size",
                "max_iters": "train_iters", "n_layer": "num_layers", "adam_epsilon": "optimizer.params.eps"}
    for name, ours in expected.items():
        with pytest.raises(ConfigError) as info:
            load_config([model_file], [f"{name}=1"])
        assert info.value.message.startswith(
            f"unknown key '{name}' at command-line override '{name}=1'; did you mean: {ours}? ('{name}' is "), name
    fields = set(NeoXArgs.model_fields)
    assert not set(OTHER_TRAINERS_NAMES) & fields
    assert {ours.split(".")[0] for ours, _, _ in OTHER_TRAINERS_NAMES.values()} <= fields
    # names the other trainers share with GPT-NeoX mean the same here: accepted as they are
    args = load_config([model_file], ["weight_decay=0.1", "gradient_accumulation_steps=4", "seed=3"]).args
    assert (args.weight_decay, args.gradient_accumulation_steps, args.seed) == (0.1, 4, 3)


def test_other_trainers_names_inside_the_optimizer_block(model_file: str) -> None:
    with pytest.raises(ConfigError, match=r"optimizer.params.learning_rate at the command line: unknown key; did "
                                          r"you mean lr\? \('learning_rate' is another trainer's name for it\)"):
        load_config([model_file], ["optimizer.params.learning_rate=0.01"])
    with pytest.raises(ConfigError, match=r"optimizer.params.adam_epsilon at the command line: .* did you mean eps\?"):
        load_config([model_file], ["optimizer.params.adam_epsilon=1e-6"])
