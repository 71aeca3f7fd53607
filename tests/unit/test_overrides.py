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
