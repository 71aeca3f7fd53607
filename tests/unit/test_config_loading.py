"""Loading and merging config files: order, spellings, lines, includes, and every structure error."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron.errors import ConfigError
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.yaml_source import resolve_config_path
from megatron.neox_arguments.provenance import format_resolved_table, resolved_rows
from megatron.neox_arguments.resolved import default_run_dir, load_resolved
from megatron.neox_arguments.yaml_source import load_yaml_file, parse_yaml_text

REPO = Path(__file__).resolve().parents[2]


def write(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return name


@pytest.fixture()
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work inside tmp_path so provenance paths are short and relative, as users see them."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return info.value.message


# --- merging and provenance ------------------------------------------------------------------------
def test_files_merge_in_order_with_file_line_provenance(cwd: Path) -> None:
    write(cwd, "model.yml", """
        # a comment line
        num-layers: 2
        hidden_size: 64
        """)
    write(cwd, "train.yml", """
        train_iters: 7
        """)
    resolved = load_config(["model.yml", "train.yml"])
    assert resolved.args.num_layers == 2 and resolved.args.hidden_size == 64 and resolved.args.train_iters == 7
    assert resolved.provenance == {"num_layers": "model.yml:2", "hidden_size": "model.yml:3", "train_iters": "train.yml:1"}
    assert set(resolved.config_files) == {"model.yml", "train.yml"}
    assert resolved.config_files["train.yml"] == "train_iters: 7\n"


def test_conf_dir_and_optional_suffix(cwd: Path) -> None:
    write(cwd, "confs/small.yml", "num_layers: 3\n")
    write(cwd, "confs/extra.yaml", "hidden_size: 32\n")
    resolved = load_config(["small", "extra"], conf_dir="confs")
    assert (resolved.args.num_layers, resolved.args.hidden_size) == (3, 32)
    assert resolved.provenance["num_layers"] == os.path.join("confs", "small.yml") + ":1"
    assert resolve_config_path("small.yml", "confs") == os.path.join("confs", "small.yml")


def test_json_config_with_comments_tracks_lines_and_reads_exponent_floats(cwd: Path) -> None:
    write(cwd, "neox.yml", """
        {
          # GPT-NeoX configs are JSON-ish YAML with comments
          "hidden_size": 64,
          "min_lr": 1e-5,
          "optimizer": {"type": "Adam", "params": {"lr": 6e-4}},
        }
        """)
    write(cwd, "plain.json", '{\n  "num_layers": 4\n}\n')
    resolved = load_config(["neox.yml", "plain.json"])
    assert resolved.args.min_lr == pytest.approx(1e-5) and isinstance(resolved.args.min_lr, float)
    # inside a dict-valued key too, where no schema type would coerce a string
    assert resolved.args.optimizer.params.lr == pytest.approx(6e-4)
    assert resolved.provenance["hidden_size"] == "neox.yml:3"
    assert resolved.provenance["num_layers"] == "plain.json:2"


def test_include_inserts_a_subtree_relative_to_the_including_file(cwd: Path) -> None:
    write(cwd, "parts/optim.yml", """
        type: Adam
        params: {lr: 3e-4}
        """)
    write(cwd, "parts/main.yml", """
        hidden_size: 64
        optimizer: !include optim.yml
        """)
    resolved = load_config(["parts/main.yml"])
    assert resolved.args.optimizer.type == "Adam" and resolved.args.optimizer.params.lr == 3e-4
    assert resolved.provenance["optimizer"] == "parts/main.yml:2"
    assert os.path.join("parts", "optim.yml") in resolved.config_files


def test_include_cycle_and_missing_include_are_errors(cwd: Path) -> None:
    write(cwd, "a.yml", "optimizer: !include b.yml\n")
    write(cwd, "b.yml", "params: !include a.yml\n")
    message = error_of(["a.yml"])
    assert "!include cycle" in message and "a.yml" in message and "b.yml" in message
    write(cwd, "c.yml", "hidden_size: 1\noptimizer: !include nowhere.yml\n")
    message = error_of(["c.yml"])
    assert message.startswith("c.yml:2:") and "!include file not found: nowhere.yml" in message


def test_merge_keys_and_anchors_still_work(cwd: Path) -> None:
    write(cwd, "m.yml", """
        fp16: &half {enabled: true, loss_scale: 0}
        optimizer:
          <<: {type: Adam, params: {lr: 1.0}}
          type: SGD
        """)
    resolved = load_config(["m.yml"])
    assert resolved.args.optimizer.type == "SGD"  # an own key overrides a merged one
    assert resolved.args.optimizer.params.lr == 1.0
    assert resolved.args.fp16 == {"enabled": True, "loss_scale": 0}


# --- structure errors ------------------------------------------------------------------------------
def test_duplicate_key_in_one_file_names_both_lines(cwd: Path) -> None:
    write(cwd, "d.yml", "hidden_size: 1\nnum_layers: 2\nhidden_size: 3\n")
    message = error_of(["d.yml"])
    assert "duplicate key 'hidden_size'" in message and "d.yml:1" in message and "d.yml:3" in message


def test_duplicate_key_spelled_with_dash_and_underscore_in_one_file(cwd: Path) -> None:
    write(cwd, "d.yml", "train-iters: 1\nhidden_size: 3\ntrain_iters: 2\n")
    message = error_of(["d.yml"])
    assert "key 'train_iters' is set twice" in message
    assert "'train-iters' at d.yml:1" in message and "'train_iters' at d.yml:3" in message


def test_duplicate_key_across_two_files_names_both_places(cwd: Path) -> None:
    write(cwd, "one.yml", "num_layers: 2\nseq_length: 128\n")
    write(cwd, "two.yml", "hidden_size: 8\nseq-length: 256\n")
    message = error_of(["one.yml", "two.yml"])
    assert "key 'seq_length' is set twice" in message
    assert "one.yml:2" in message and "two.yml:2" in message


def test_duplicate_nested_key_is_an_error(cwd: Path) -> None:
    write(cwd, "n.yml", "optimizer:\n  type: Adam\n  type: SGD\n")
    message = error_of(["n.yml"])
    assert "duplicate key 'type'" in message and "n.yml:2" in message and "n.yml:3" in message


def test_same_file_twice_is_an_error(cwd: Path) -> None:
    write(cwd, "a.yml", "num_layers: 2\n")
    assert "a.yml is given twice" in error_of(["a.yml", "a"])


def test_unknown_keys_are_reported_together_with_lines_and_suggestions(cwd: Path) -> None:
    write(cwd, "u.yml", "hiden_size: 64\nnum_layers: 2\ntrain_iterz: 5\nzzzz_qqqq: 1\n")
    message = error_of(["u.yml"])
    assert message.startswith("3 problems in the config:")
    assert "unknown key 'hiden_size' at u.yml:1; did you mean: hidden_size" in message
    assert "unknown key 'train_iterz' at u.yml:3; did you mean: train_iters" in message
    assert "unknown key 'zzzz_qqqq' at u.yml:4; see configs/neox_arguments.md" in message


def test_malformed_yaml_reports_file_line_and_column(cwd: Path) -> None:
    write(cwd, "bad.yml", "num_layers: 2\nhidden_size: [64\nseq_length: 3\n")
    message = error_of(["bad.yml"])
    assert message.startswith("bad.yml:3:11: malformed YAML:"), message
    write(cwd, "tab.yml", "num_layers: 2\n\thidden_size: 3\n")
    assert error_of(["tab.yml"]).startswith("tab.yml:2:1: malformed YAML:")


def test_python_object_tags_are_refused(cwd: Path) -> None:
    write(cwd, "evil.yml", "num_layers: 2\nhidden_size: !!python/object/apply:os.system ['echo hacked']\n")
    message = error_of(["evil.yml"])
    assert message.startswith("evil.yml:2:14:") and "python/object/apply:os.system" in message
    assert "safe YAML only" in message
    write(cwd, "odd.yml", "num_layers: !custom 2\n")
    assert "unknown YAML tag '!custom'" in error_of(["odd.yml"])


def test_missing_config_file_lists_where_it_looked(cwd: Path) -> None:
    message = error_of(["nothere"], conf_dir="confs")
    assert "config file not found: nothere" in message
    assert os.path.join("confs", "nothere.yml") in message
    assert "no config file given" in error_of([])


def test_top_level_must_be_a_mapping_and_empty_files_are_fine(cwd: Path) -> None:
    write(cwd, "list.yml", "- 1\n- 2\n")
    assert "list.yml: a config file must be a mapping" in error_of(["list.yml"])
    write(cwd, "empty.yml", "# nothing yet\n")
    write(cwd, "x.yml", "num_layers: 2\n")
    assert load_config(["empty.yml", "x.yml"]).args.num_layers == 2


def test_wrong_types_listed_one_per_key_with_value_type_and_place(cwd: Path) -> None:
    write(cwd, "t.yml", "num_layers: two\nprecision: fp8\nhidden_size: 64\n")
    message = error_of(["t.yml"])
    assert message.startswith("2 problems in the config:")
    assert "num_layers = 'two' at t.yml:1: expected int" in message
    assert "precision = 'fp8' at t.yml:2: expected 'fp16' | 'fp32' | 'bfloat16'" in message


def test_bad_value_of_a_constrained_field(cwd: Path) -> None:
    write(cwd, "v.yml", "attention_config: 3\n")
    message = error_of(["v.yml"])
    assert "attention_config = 3 at v.yml:1: expected list" in message


def test_unsupported_key_set_away_from_default(cwd: Path) -> None:
    write(cwd, "s.yml", "num_layers: 2\nsparsity_config: {block: 16}\n")
    message = error_of(["s.yml"])
    assert "is obsolete" in message and "sparsity_config" in message and "s.yml:2" in message
    write(cwd, "ok.yml", "sparsity_config: null\n")  # at its default: accepted
    assert load_config(["ok.yml"]).args.sparsity_config is None


def test_yaml_text_parser_direct() -> None:
    assert parse_yaml_text("a: 1e3\nb: -2.5E-2\nc: '1e3'\nd: 10", "x") == {"a": 1000.0, "b": -0.025, "c": "1e3", "d": 10}
    assert parse_yaml_text("run: 2024-01-01\nat: 2024-01-01 10:00:00", "x") == {"run": "2024-01-01", "at": "2024-01-01 10:00:00"}
    assert yaml.safe_load("run: 2024-01-01")["run"] != "2024-01-01"  # the plain SafeLoader is untouched
    with pytest.raises(ConfigError, match="config file not found"):
        load_yaml_file("/definitely/not/here.yml")


# --- the resolved-config file ----------------------------------------------------------------------
def test_resolved_config_round_trip_is_atomic(cwd: Path) -> None:
    write(cwd, "r.yml", "num_layers: 2\nhidden_size: 64\noptimizer: {type: Adam, params: {lr: 1e-3}}\n")
    resolved = load_config(["r.yml"], ["train_iters=5"])
    resolved.deepspeed_config = {"train_batch_size": 4}
    resolved.directory = "runs/x"
    target = resolved.write(cwd / "run" / "deepy_config.json")
    assert sorted(os.listdir(cwd / "run")) == ["deepy_config.json"]  # no temp file left behind
    data = json.loads(target.read_text())
    assert data["provenance"]["train_iters"] == "cli" and data["deepspeed_config"] == {"train_batch_size": 4}
    back = load_resolved(target)
    assert back.args == resolved.args
    assert back.provenance == resolved.provenance and back.config_files == resolved.config_files
    assert back.deepspeed_config == {"train_batch_size": 4} and back.directory == "runs/x"


def test_load_resolved_errors(cwd: Path) -> None:
    with pytest.raises(ConfigError, match="resolved config not found: nope.json; it is written by deepy.py"):
        load_resolved("nope.json")
    (cwd / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read resolved config junk.json"):
        load_resolved("junk.json")
    (cwd / "other.json").write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="not a resolved config written by deepy.py"):
        load_resolved("other.json")


def test_default_run_dir_uses_log_dir_and_timestamp() -> None:
    from datetime import datetime

    when = datetime(2026, 1, 2, 3, 4, 5)
    assert default_run_dir("logs", when) == Path("logs/20260102-030405")
    assert default_run_dir(None, when) == Path("runs/20260102-030405")


def test_provenance_table_is_aligned_and_marks_derived_values(cwd: Path) -> None:
    write(cwd, "p.yml", "num_layers: 2\nhidden_size: 64\n")
    resolved = load_config(["p.yml"], ["optimizer.type=Adam", "optimizer.params.lr=0.5"])
    resolved.args.train_batch_size = 8  # as the rules would derive it, without recording provenance
    rows = {key: (value, source) for key, value, source in resolved_rows(resolved.args, resolved.provenance)}
    assert rows["num_layers"] == ("2", "p.yml:1")
    assert rows["optimizer.params.lr"] == ("0.5", "cli")
    assert rows["train_batch_size"] == ("8", "derived")
    assert "config_files" not in rows
    lines = format_resolved_table(resolved.args, resolved.provenance).splitlines()
    key_width = max(len(key) for key in rows)
    for line in lines:  # every value starts in the same column, right after the widest key
        assert line[key_width : key_width + 2] == "  " and line[key_width + 2] != " ", lines
    assert any(line.startswith("num_layers ") and line.endswith("  p.yml:1") for line in lines)


# --- every shipped config ---------------------------------------------------------------------------
def shipped_model_configs() -> list[str]:
    skip = {"local_setup.yml"}
    paths = sorted(p for p in (REPO / "configs").glob("**/*.yml") if p.name not in skip)
    return [str(p.relative_to(REPO)) for p in paths]


def test_configs_directory_is_not_empty() -> None:
    names = shipped_model_configs()
    assert "configs/125M.yml" in names and "configs/tiny.yml" in names and len(names) >= 20


@pytest.mark.parametrize("config", shipped_model_configs())
def test_every_shipped_config_resolves_with_local_setup(config: str, local_setup_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.neox_arguments import deepspeed_config, detect_world_size, finalize

    monkeypatch.chdir(local_setup_dir)
    resolved = load_config([config, "configs/local_setup.yml"])
    final = finalize(resolved, detect_world_size(resolved.args))
    ds = deepspeed_config(final.args)
    assert isinstance(ds, dict) and ds.get("train_batch_size", 0) > 0
    assert final.provenance.get("num_layers", "").startswith(config + ":")
