"""Plug-ins carry their own config: a toy LR schedule, tracker, objective and tokenizer, each one
file, work through ``deepy.py --dry-run`` (their keys validated, shown with file:line, checked before
launch) and do what they say; the accepted values of every plug-in key are its registry's names.

The four toy files are written here into a temporary directory, as a user would write them next
to their config, and named by the config's ``plugins:`` key. Each toy has its own test below with an
independent reference (the formula, the rows logged, torch's label-smoothed cross entropy, the
letters' places in the alphabet).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron import plugins
from megatron.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

TOY_SCHEDULE = '''
"""Step decay: halve the rate every ``step_decay_every`` decay steps."""
from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.engine.lr_schedules import register_decay


class StepDecayKeys(ArgGroup):
    """Keys of the step-decay schedule."""

    step_decay_every: int = Field(100, ge=1)
    """Halve the rate every this many steps of the decay phase."""


def _check(args, show):
    if args.train_iters is not None and args.step_decay_every > args.train_iters:
        return [f"{show('step_decay_every')} is longer than {show('train_iters')}: the rate would never drop"]
    return []


@register_decay("step_halving", keys=StepDecayKeys, check=_check)
def step_halving(progress, steps, spec):
    return 0.5 ** (steps // spec.option("step_decay_every"))
'''

TOY_TRACKER = '''
"""A tracker that appends every logged scalar to a CSV file."""
import csv
from typing import Literal

from megatron import plugins
from megatron.logging.trackers import TrackerBlock, scalars


class CsvBlock(TrackerBlock):
    """``tracker: {type: csv, path: ...}``."""

    type: Literal["csv"] = "csv"
    path: str
    """The CSV file (step, key, value rows)."""


@plugins.register("tracker", "csv", block=CsvBlock)
class CsvTracker:
    def __init__(self, settings, ctx, log_dir):
        self.path = settings.block.path

    def log(self, row, step):
        with open(self.path, "a", newline="") as handle:
            writer = csv.writer(handle)
            for key, value in scalars(row).items():
                writer.writerow([step, key, value])

    def finish(self, failed=False):
        pass
'''

TOY_OBJECTIVE = '''
"""Language modelling with label smoothing (``label_smoothing`` of the target mass spread evenly)."""
import torch
import torch.nn.functional as F
from pydantic import Field

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.objectives.lm import LMObjective


class SmoothingKeys(ArgGroup):
    """Keys of the label-smoothed objective."""

    label_smoothing: float = Field(0.1, ge=0, lt=1)
    """Share of each target's probability spread over the vocabulary."""


@plugins.register("train_impl", "smoothed_lm", keys=SmoothingKeys, documents=True)
class SmoothedLM(LMObjective):
    def loss_sum(self, output, labels, extras, reference):
        counted = labels >= 0
        flat = output.float().reshape(-1, output.shape[-1])
        losses = F.cross_entropy(flat, labels.clamp(min=0).reshape(-1), reduction="none",
                                 label_smoothing=self.config.label_smoothing)
        total = (losses * counted.reshape(-1)).sum()
        return total, {"lm_loss": (total.detach(), counted.sum())}
'''


TOY_TOKENIZER = '''
"""Letters as tokens: each character of ``letters_alphabet`` is its place in it + 1; 0 ends a document."""
from pydantic import Field

from megatron import plugins
from megatron.config_schema import ArgGroup
from megatron.tokenizer.base import Tokenizer


class LettersKeys(ArgGroup):
    """Keys of the letters tokenizer."""

    letters_alphabet: str = Field("abcdefghijklmnopqrstuvwxyz ", min_length=1)
    """The characters it encodes, in id order (other characters are dropped)."""


def _check(args, show):
    if len(set(args.letters_alphabet)) != len(args.letters_alphabet):
        return [f"{show('letters_alphabet')} repeats a character: each character needs one id"]
    return []


@plugins.register("tokenizer_type", "letters", keys=LettersKeys, check=_check)
class LettersTokenizer(Tokenizer):
    name = "letters"

    def __init__(self, alphabet):
        self.ids = {char: place + 1 for place, char in enumerate(alphabet)}
        self.chars = {place: char for char, place in self.ids.items()}

    @classmethod
    def from_config(cls, config):
        return cls(config.letters_alphabet)

    @property
    def vocab_size(self):
        return len(self.ids) + 1

    @property
    def eod(self):
        return 0

    def tokenize(self, text):
        return [self.ids[char] for char in text if char in self.ids]

    def detokenize(self, ids):
        return "".join(self.chars.get(i, "") for i in ids)
'''

TOYS = ("step_halving.py", "csv_tracker.py", "smoothed_lm.py", "letters.py")


@pytest.fixture(scope="module")
def toys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("toys")
    for name, text in zip(TOYS, (TOY_SCHEDULE, TOY_TRACKER, TOY_OBJECTIVE, TOY_TOKENIZER)):
        (folder / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return folder


def _config(folder: Path, extra: str, tokenizer: str = "CharLevelTokenizer") -> Path:
    data = folder / "data.txt"
    data.write_text("plug-ins carry their own keys\n", encoding="utf-8")
    text = textwrap.dedent(f"""\
        plugins: [{', '.join(TOYS)}]
        num_layers: 2
        hidden_size: 64
        num_attention_heads: 4
        seq_length: 32
        max_position_embeddings: 32
        tokenizer_type: {tokenizer}
        use_dummy_dataset: true
        train_micro_batch_size_per_gpu: 2
        train_iters: 40
        lr: 0.001
        """) + textwrap.dedent(extra)
    path = folder / f"run{abs(hash(extra))}.yml"
    path.write_text(text, encoding="utf-8")
    return path


def _dry_run(config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", "train.py", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _line_of(config: Path, key: str) -> int:
    return next(i for i, line in enumerate(config.read_text().splitlines(), 1) if line.lstrip().startswith(key))


def test_four_toy_plugins_run_through_deepy_dry_run(toys: Path) -> None:
    config = _config(toys, """\
        lr_decay_style: step_halving
        step_decay_every: 10
        train_impl: smoothed_lm
        label_smoothing: 0.2
        tracker: {type: csv, path: metrics.csv}
        letters_alphabet: "abc "
        """, tokenizer="letters")
    done = _dry_run(config)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for key, value in (("lr_decay_style", "step_halving"), ("step_decay_every", "10"),
                       ("train_impl", "smoothed_lm"), ("label_smoothing", "0.2"), ("tokenizer_type", "letters"),
                       ("letters_alphabet", "abc ")):
        row = next(line for line in out.splitlines() if line.split() and line.split()[0] == key)
        assert value in row and f"{config.name}:{_line_of(config, key)}" in row, row
    assert "csv" in next(line for line in out.splitlines() if line.split() and line.split()[0] == "tracker")


def test_a_plugins_check_refuses_before_launch_with_file_and_line(toys: Path) -> None:
    config = _config(toys, """\
        lr_decay_style: step_halving
        step_decay_every: 400
        letters_alphabet: abca
        """, tokenizer="letters")
    done = _dry_run(config)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"step_decay_every=400 ({config}:{_line_of(config, 'step_decay_every')})" in done.stderr
    assert "would never drop" in done.stderr
    assert f"letters_alphabet='abca' ({config}:{_line_of(config, 'letters_alphabet')}) repeats a character" \
        in done.stderr


def test_a_plugins_keys_without_the_plugin_selected_are_refused(toys: Path) -> None:
    config = _config(toys, """\
        lr_decay_style: cosine
        step_decay_every: 10
        letters_alphabet: xyz
        """)
    done = _dry_run(config)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"step_decay_every=10 ({config}:{_line_of(config, 'step_decay_every')}) only apply to " \
           "lr_decay_style: step_halving" in done.stderr
    assert f"letters_alphabet='xyz' ({config}:{_line_of(config, 'letters_alphabet')}) only apply to " \
           "tokenizer_type: letters" in done.stderr


def test_an_unregistered_name_lists_the_registry(toys: Path) -> None:
    config = _config(toys, "tracker: {type: comet}\n")
    done = _dry_run(config)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "'comet' is not one of the registered tracker values: wandb, tensorboard, csv" in done.stderr
    assert f"{config.name}:{_line_of(config, 'tracker')}" in done.stderr


# ---- each toy does what it says (in-process, the same files) ----------------------------------------


@pytest.fixture(scope="module")
def loaded(toys: Path) -> Iterator[Path]:
    """The toys registered in this process for this module's tests, and forgotten after them: other
    test files on this worker must see Deepy's own registry (the docs, the honesty index)."""
    saved = {family: dict(entries) for family, entries in plugins._REGISTRY.items()}
    plugins.load_user_plugins(list(TOYS), base_dir=str(toys))
    yield toys
    for family, entries in saved.items():
        plugins._REGISTRY[family].clear()
        plugins._REGISTRY[family].update(entries)
    plugins._USER_MODULES.clear()


def test_toy_schedule_halves_every_k_steps(loaded: Path) -> None:
    from megatron.engine.lr_schedules import ScheduleSpec, lr_at

    spec = ScheduleSpec(style="step_halving", max_lr=1.0, total_steps=100, warmup_steps=0,
                        options=(("step_decay_every", 10),))
    assert [lr_at(spec, s) for s in (0, 9, 10, 25, 99)] == [1.0, 1.0, 0.5, 0.25, 0.5**9]


def test_toy_tracker_receives_every_row(loaded: Path, tmp_path: Path) -> None:
    from megatron.logging.trackers import TrackerContext, build_trackers
    from megatron.neox_arguments.loading import config_from_mapping

    target = tmp_path / "m.csv"
    args = config_from_mapping({"tracker": {"type": "csv", "path": str(target)}}).args
    trackers = build_trackers(args.tracker_settings(), TrackerContext(rank=0, speaks=True, run_id=None, start_step=0),
                              None)
    trackers.log({"train/lm_loss": 2.5, "note": "text"}, step=3)
    trackers.log({"train/lm_loss": 2.0}, step=4)
    with target.open() as handle:
        assert list(csv.reader(handle)) == [["3", "train/lm_loss", "2.5"], ["4", "train/lm_loss", "2.0"]]


def test_toy_objective_is_torchs_label_smoothed_cross_entropy(loaded: Path) -> None:
    from megatron.neox_arguments.arguments import schema_class
    from megatron.objectives import build_objective

    objective = build_objective(schema_class()(train_impl="smoothed_lm", label_smoothing=0.2))
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    total, _ = objective.loss_sum(logits, labels, (), torch.zeros(2))
    keep = labels.reshape(-1) >= 0
    expected = F.cross_entropy(logits.reshape(-1, 11)[keep], labels.reshape(-1)[keep], label_smoothing=0.2,
                               reduction="sum")
    assert torch.allclose(total, expected, atol=1e-5)
    plain = F.cross_entropy(logits.reshape(-1, 11)[keep], labels.reshape(-1)[keep], reduction="sum")
    assert not torch.allclose(total, plain)  # the key has an effect


def test_toy_tokenizer_numbers_letters_by_their_place_in_the_alphabet(loaded: Path) -> None:
    from megatron.neox_arguments.arguments import schema_class
    from megatron.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(schema_class()(tokenizer_type="letters"))  # the default alphabet, a-z then space
    text = "plug ins, carry keys!"
    expected = [27 if char == " " else ord(char) - ord("a") + 1 for char in text if char.isalpha() or char == " "]
    assert tokenizer.tokenize(text) == expected
    assert tokenizer.detokenize(expected) == "plug ins carry keys"
    assert tokenizer.vocab_size == 28 and tokenizer.eod == 0
    short = build_tokenizer(schema_class()(tokenizer_type="letters", letters_alphabet="cab"))
    assert short.tokenize("abcd") == [2, 3, 1]  # the key has an effect


# ---- the registries are the accepted values --------------------------------------------------------


@pytest.mark.parametrize("family", sorted(plugins.FAMILIES))
def test_accepted_values_of_a_plugin_key_are_its_registry(family: str) -> None:
    from megatron.neox_arguments.loading import config_from_mapping

    for name in plugins.names(family):  # type: ignore[arg-type]
        value = {"type": name} if family == "tracker" else name
        extra = {"path": "x.csv"} if name == "csv" else {}
        if family == "tracker":
            value = {**value, **extra}
        assert config_from_mapping({family: value}).args is not None
    bogus = {"type": "not_registered"} if family == "tracker" else "not_registered"
    with pytest.raises(ConfigError, match="not one of the registered"):
        config_from_mapping({family: bogus})
    if family != "tracker":  # a flat selecting key: the generated docs list exactly the registry as its type
        from megatron.neox_arguments.docs import render_markdown

        row = next(line for line in render_markdown().splitlines() if line.startswith(f"| `{family}` |"))
        assert row.split(" | ")[1] == " \\| ".join(f'"{name}"' for name in plugins.names(family))  # type: ignore[arg-type]


NEOX_VALUES: dict[str, tuple[str, ...]] = {
    "tokenizer_type": ("GPT2BPETokenizer", "HFTokenizer", "HFGPT2Tokenizer", "SPMTokenizer", "CharLevelTokenizer",
                       "TiktokenTokenizer"),
    "train_impl": ("normal", "dpo", "rm", "kto", "reinforce"),
}
"""GPT-NeoX's values of its keys that are plug-in registries now (its Literals, gpt-neox-arguments.tsv): each stays
accepted, spelt the same."""


@pytest.mark.parametrize("family", sorted(NEOX_VALUES))
def test_gpt_neox_values_stay_registered(family: str) -> None:
    from megatron.neox_arguments.loading import config_from_mapping

    assert set(NEOX_VALUES[family]) <= set(plugins.names(family))  # type: ignore[arg-type]
    for name in NEOX_VALUES[family]:
        assert getattr(config_from_mapping({family: name}).args, family) == name


def test_optimizer_types_are_the_builders_registry() -> None:
    from megatron.engine.optimizer_block import OPTIMIZER_KINDS
    from megatron.engine.optimizers import DEEPSPEED_BUILT, NAMED_OPTIMIZERS, OPTIMIZERS

    # every accepted optimizer.type is built by us (given each parameter's name where its update needs it) or, for
    # 1-bit Adam, by DeepSpeed from its block
    assert set(OPTIMIZER_KINDS.values()) == set(OPTIMIZERS) | set(NAMED_OPTIMIZERS) | DEEPSPEED_BUILT
    assert not set(OPTIMIZERS) & DEEPSPEED_BUILT and not set(OPTIMIZERS) & set(NAMED_OPTIMIZERS)


def test_one_name_registered_by_two_modules_is_refused() -> None:
    with pytest.raises(ConfigError, match="registered twice"):
        plugins.declare("lr_decay_style", "cosine", module="elsewhere")


# ---- Deepy's own entries: names and needs low, implementations attached by their layer ---------------


def test_the_objectives_names_and_needs_are_read_without_the_objectives_package() -> None:
    """The data and checkpoint layers read an objective's needs from megatron/objective_needs.py, below them;
    the objectives layer (megatron/objectives/) is not imported for it."""
    code = ("import sys\nfrom megatron.objective_needs import needs_of\n"
            "print(needs_of('rm').value_head, needs_of('dpo').dataset, "
            "sorted(m for m in sys.modules if m.startswith('megatron.objectives')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "pairwise", "[]"]


def test_the_objectives_layer_attaches_keys_checks_and_classes() -> None:
    from megatron.objectives.config import DPOKeys
    from megatron.objectives.dpo import DPOObjective

    dpo = plugins.get("train_impl", "dpo")
    assert dpo.module == "megatron.objective_needs" and dpo.needs["dataset"] == "pairwise"
    assert dpo.keys is DPOKeys and dpo.check is not None and dpo.resolve() is DPOObjective


def test_a_family_read_before_its_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a family whose table of Deepy's own entries was not imported is a programming error, not an
    empty list of accepted values."""
    monkeypatch.setattr(plugins, "_DECLARED", set())
    with pytest.raises(LookupError, match="train_impl plug-ins are read before"):
        plugins.names("train_impl")


def test_an_implementation_attached_to_an_undeclared_name_is_refused() -> None:
    with pytest.raises(ValueError, match="never declared"):
        plugins.attach("train_impl", "no_such_objective", target=object)


def test_a_declared_entry_without_its_implementation_says_so() -> None:
    with pytest.raises(LookupError, match="nothing attached its implementation"):
        plugins.Plugin("train_impl", "bare", module="somewhere").resolve()
