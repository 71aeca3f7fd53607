"""W&B without a login, before launch (issue 42 item 12).

Levanter's default tracker is W&B (``TrainerConfig.tracker = WandbConfig()``, levanter ``trainer.py:655`` at
9263f81e); without an API key ``wandb.init`` stops every rank after the model is built ("No API key configured").
:func:`megatron.logging.wandb_login.login_state` answers with wandb 0.31.0's own order (its settings, key
validation and netrc reader); the reference for "no key" is ``wandb.init`` itself, run in a process without a
terminal in the same environment. Each test gets an empty home, wandb settings directory and netrc path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.errors import ConfigError
from megatron.logging.wandb_login import login_state

REPO = Path(__file__).resolve().parents[2]
HOST = "https://api.wandb.ai"
KEY = "k" * 40  # the form wandb accepts (40+ characters); never sent anywhere: no test here starts a run online


@pytest.fixture()
def no_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine where nobody ran `wandb login`: no key in the environment, no netrc, no wandb settings."""
    for name in [n for n in os.environ if n.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def wandb_init_without_a_terminal(home: Path) -> str:
    """What wandb.init itself says here (mode left to W&B, as Deepy's tracker passes it), stdin not a terminal."""
    code = ("import wandb\ntry:\n    wandb.init(project='p', mode=None, settings=wandb.Settings(console='off'))\n"
            "    print('STARTED')\nexcept Exception as err:\n    print(type(err).__name__, err)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=home, env=dict(os.environ), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1]


def test_no_key_is_what_wandb_init_refuses(no_login: Path) -> None:
    assert login_state(HOST, None).state == "no_key"
    assert wandb_init_without_a_terminal(no_login) == "UsageError No API key configured. Use `wandb login` to log in."


def test_login_state_follows_wandbs_order(no_login: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode first (the tracker's, WANDB_MODE, the settings file `wandb offline` writes), then the key: the
    environment, the host's netrc entry (what `wandb login` writes), wandb's settings."""
    assert login_state(HOST, "offline").state == "no_login_needed"
    assert login_state(HOST, "disabled").state == "no_login_needed"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert login_state(HOST, None) == login_state(HOST, None).__class__("no_login_needed", "offline")
    assert login_state(HOST, "online").state == "no_key"  # the run's own mode wins over the environment's
    monkeypatch.delenv("WANDB_MODE")
    settings = no_login / "wandb-config" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\nmode = offline\n")
    assert login_state(HOST, None).state == "no_login_needed"
    settings.unlink()
    (no_login / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    (no_login / ".netrc").chmod(0o600)
    assert login_state(HOST, None).state == "logged_in"
    assert login_state("https://wandb.example.org", None).state == "no_key"  # another host's entry
    (no_login / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    assert login_state(HOST, None).state == "logged_in"
    monkeypatch.setenv("WANDB_API_KEY", "short")
    bad = login_state(HOST, None)
    assert bad.state == "bad_key" and "40+ characters" in bad.detail


def levanter_dry_run(tmp: Path, *flags: str, launch: tuple[str, ...] = ("--num_gpus", "1")):  # noqa: ANN201
    """A Levanter config with no tracker section (its default, W&B), through every check of ``deepy.py --dry-run``."""
    from megatron.app.deepy import parse_command, resolve
    from tests.unit.test_dialects import write_local_data

    write_local_data(tmp)
    (tmp / "run.yaml").write_text(
        'data:\n  train_urls: ["train.1.jsonl"]\n  validation_urls: ["val.jsonl"]\n  cache_dir: cache\n'
        "  tokenizer: tokenizer.json\nmodel:\n  type: gpt2\n  hidden_dim: 64\n  num_heads: 4\n  num_layers: 2\n"
        "  seq_len: 32\ntrainer:\n  mp: p=f32,c=f32\n  fsdp_axis: null\n  train_batch_size: 2\n"
        "  num_train_steps: 2\n  tracker:\n    save_code: false\n")
    return resolve(parse_command(["--dry-run", str(REPO / "train.py"), "--config_path", "run.yaml", *launch, *flags]))


def test_levanters_default_tracker_without_a_key_runs_offline_and_says_so(no_login: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = levanter_dry_run(no_login)
    assert resolved.args.tracker.mode == "offline"  # what the ranks' wandb.init gets
    said = [w for w in resolved.warnings if w.startswith("W&B (")]
    assert len(said) == 1 and "no W&B API key on this machine" in said[0] and "logs to W&B offline" in said[0]
    assert "`wandb login`" in said[0] and "WANDB_MODE=offline" in said[0] and "tracker.type noop" in said[0]
    # a machine that can log in, or a run told to be offline, is left as it is
    monkeypatch.setenv("WANDB_MODE", "offline")
    resolved = levanter_dry_run(no_login)
    assert resolved.args.tracker.mode is None and not any(w.startswith("W&B (") for w in resolved.warnings)


def test_mode_online_said_explicitly_without_a_key_is_refused(no_login: Path) -> None:
    with pytest.raises(ConfigError, match=r"W&B \(--trainer.tracker.mode online .*\) asks for mode online, but no W&B "
                                          r"API key on this machine .* run `wandb login` .*WANDB_MODE=offline"):
        levanter_dry_run(no_login, "--trainer.tracker.mode", "online")


def test_ranks_on_other_machines_are_not_judged_by_this_one(no_login: Path) -> None:
    resolved = levanter_dry_run(no_login, launch=("--launcher", "slurm", "--num_gpus", "2"))
    assert resolved.args.tracker.mode is None
    assert any(s.startswith("the W&B login of the ranks' machines") for s in resolved.skipped)


def test_gpt_neox_use_wandb_without_a_key_runs_offline(no_login: Path) -> None:
    """GPT-NeoX's own local_setup.yml says ``use_wandb: True``; GPT-NeoX, finding no key, skips W&B
    (``megatron/utils.py:144-183`` at ea7aefd8). Deepy keeps the rows: the same W&B run, offline."""
    from megatron.app.deepy import parse_command, resolve
    from megatron.logging.config import WandbSettings
    from megatron.neox_arguments.run_config import RunConfig

    resolved = resolve(parse_command(["--dry-run", str(REPO / "train.py"), str(REPO / "configs" / "tiny.yml"),
                                      "use_dummy_dataset=true", "tokenizer_type=CharLevelTokenizer",
                                      "checkpoint_factor=null", "use_wandb=true", "wandb_project=mine"]))
    wandb = [t for t in RunConfig.from_resolved(resolved).logging.tracker_settings() if isinstance(t, WandbSettings)]
    assert len(wandb) == 1 and (wandb[0].mode, wandb[0].project) == ("offline", "mine")
    assert any(w.startswith("use_wandb=True (command line): no W&B API key") for w in resolved.warnings)
