"""GPT-NeoX's own configs and its configuration guide's examples, launched as a GPT-NeoX user on a
Slurm cluster would (``launcher=slurm deepspeed_slurm=true num_gpus=8``) from this CPU machine.

Each must pass ``--dry-run`` unchanged, or be refused before launch naming, in one message, every key
of a feature Deepy lacks. The fixtures under ``tests/fixtures/neox_configs/`` hold the keys and values
of GPT-NeoX's files (same layout as its ``configs/``, comments left out); their data and tokenizer
paths point at files this machine does not have, which a Slurm launch only warns about.

Most cases run through the Python API (``parse_command`` -> ``resolve`` -> ``render_dry_run``, the
path ``deepy.py`` takes); a few real ``deepy.py`` subprocesses check exit codes and that no
traceback is printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron.app.deepy import parse_command, render_dry_run, resolve
from megatron.config_rules import Device
from megatron.config_schema import BITSANDBYTES, TRANSFORMER_ENGINE, gpu_library_missing
from megatron.errors import ConfigError, DeepyError
from megatron.neox_arguments.keys import normalize_key
from megatron.neox_arguments.resolved import ResolvedConfig
from megatron.neox_arguments.run_config import RunConfig

# libyaml's loader where built (the fixtures are read many times); the results are the same
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

REPO = Path(__file__).resolve().parents[2]
NEOX = REPO / "tests" / "fixtures" / "neox_configs"
SLURM = ["launcher=slurm", "deepspeed_slurm=true", "num_gpus=8"]


@pytest.fixture(autouse=True, scope="module")
def away_from_the_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Resolve from an empty directory: local_setup.yml's relative save/load (``checkpoints``) must not
    meet the checkpoints a quick start leaves in the repository root (CI trains there before the tests),
    which the dry run reads and compares with the config."""
    previous = os.getcwd()
    os.chdir(here := tmp_path_factory.mktemp("cwd"))
    yield here
    os.chdir(previous)
LAUNCHING_MACHINE = Device.detect()
"""What this machine's devices can do (the rules ask the same)."""

# Keys GPT-NeoX's configs set whose feature another branch is building right now: refused today, and
# expected to be refused by the cases below until that branch lands. Empty an entry when it does.
PENDING_FEATURES: dict[str, frozenset[str]] = {}
PENDING_KEYS: frozenset[str] = frozenset().union(*PENDING_FEATURES.values())

# the keys whose files a launch reads, and which a Slurm launch from here must only warn about
PATH_KEYS = ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths", "vocab_file", "merge_file")


@dataclass(frozen=True)
class Case:
    """GPT-NeoX config files merged in order, and the keys a dry run refuses (besides pending ones)."""

    files: tuple[str, ...]
    unsupported: frozenset[str] = frozenset()
    """Keys of features Deepy lacks, all named in one "not supported yet" message."""
    unknown: frozenset[str] = frozenset()
    """Keys refused as unknown (not in GPT-NeoX's current argument list)."""
    duplicate: frozenset[str] = frozenset()
    """Keys set by two files (GPT-NeoX's own check misses differently spelled duplicates)."""
    overrides: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    """Parts of the problems a dry run reports (configs GPT-NeoX refuses too)."""

    @property
    def id(self) -> str:
        return "+".join(Path(f).with_suffix("").as_posix() for f in self.files)


def case(*files: str, unsupported: tuple[str, ...] = (), unknown: frozenset[str] = frozenset(),
         duplicate: tuple[str, ...] = (), overrides: tuple[str, ...] = (), problems: tuple[str, ...] = ()) -> Case:
    return Case(files, frozenset(unsupported), unknown, frozenset(duplicate), overrides, problems)


LOCAL = "local_setup.yml"
LLAMA_TRAIN = "llama/train_config.yml"
SAVE_ONLY = "<save-only local setup>"  # for configs that carry their own data and tokenizer
MAMBA_TRAINING = ("train_micro_batch_size_per_gpu=4", "lr=0.0006", "train_iters=100", "checkpoint_factor=100")

CASES: list[Case] = [
    *(case(name, LOCAL) for name in (
        "19M.yml", "49M.yml", "125M.yml", "125M-json.yml", "350M.yml", "760M.yml", "800M.yml", "1-3B.yml",
        "2-7B.yml", "6-7B.yml", "13B.yml", "175B.yml", "bf16_125M.yml")),
    case("20B.yml"),  # carries its own data, tokenizer and checkpoint paths
    *(case(f"pythia/{name}", LOCAL) for name in ("70M.yml", "160M.yml", "410M.yml", "1B.yml", "1-4B.yml",
                                                  "2-8B.yml", "6-9B.yml", "12B.yml")),
    case("pythia/14M.yml", SAVE_ONLY),
    case("pythia/31M.yml", SAVE_ONLY),
    *(case(name, LLAMA_TRAIN, LOCAL) for name in (
        "llama/7B.yml", "llama/13B.yml", "llama/30B.yml", "llama/65B.yml", "llama2/7B.yml", "llama2/13B.yml",
        "llama2/70B.yml", "llama2/codellama_7B.yml", "llama2/codellama_34B.yml", "mistral/7B.yml")),
    case("finetuning_configs/6-9B.yml", "slurm_local.yml"),
    # GPT-NeoX's MoE configs of the release in the index (megablocks/DeepSpeed-era keys): the dropless one
    # loads; the DeepSpeed one drops tokens beyond expert capacity, which GPT-NeoX itself removed (obsolete)
    case("125M-dmoe.yml", LOCAL),
    case("125M-moe.yml", LOCAL, problems=("moe_token_dropping: True is obsolete: GPT-NeoX removed token dropping",)),
    # features Deepy lacks
    # the Mamba files of this release hold the model only: the training keys come from the command line. Their
    # fused-kernel keys are the cluster's business (a Slurm launch only warns). mamba-370M/790M repeat their
    # layer type 64 times over 48 layers, which GPT-NeoX refuses too (fixed in its later files).
    *(case(f"mamba/mamba-{size}.yml", LOCAL, overrides=MAMBA_TRAINING) for size in ("130M", "1.4B", "2.8B")),
    *(case(f"mamba/mamba-{size}.yml", LOCAL, overrides=MAMBA_TRAINING,
           problems=("attention_config describes 64 layers but num_layers=48",)) for size in ("370M", "790M")),
    # the RWKV files' bf16 block carries DeeperSpeed's loss-scale fields: no effect there, left out here (said)
    *(case(f"rwkv/{size}.yml", LOCAL) for size in ("170M", "430M", "1.5B")),
    # CUDA-only libraries: refused where the library or the GPU is missing (tests/unit/test_gpu_libraries.py)
    case("1-3B-transformer-engine.yml", LOCAL,
         problems=("te_layernorm_mlp: True needs Transformer Engine", "te_mha: True needs Transformer Engine")
         if gpu_library_missing(TRANSFORMER_ENGINE) else ()),
    case("bnb_125M.yml", LOCAL, problems=("use_bnb_optimizer: True needs bitsandbytes",)
         if gpu_library_missing(BITSANDBYTES) else ()),
    case("gmlp_small.yml", LOCAL),  # (its eps 1.0e_8 is a string in YAML)
    case("125M.yml", "sparse.yml", LOCAL, problems=("sparsity_config: ", "is obsolete: DeepSpeed's block-sparse")),
    # Deepy refuses a key set in two files however it is spelled; GPT-NeoX only when spelled alike,
    # so Pythia + its docker paths file (tokenizer_type / tokenizer-type) loads there
    case("pythia/160M.yml", "docker/pythia-paths.yml", duplicate=("tokenizer_type",)),
]


def test_every_fixture_has_a_case() -> None:
    used = {f for c in CASES for f in c.files} | {"guide/gpt3_small.yml", "guide/data_setup.yml",
                                                   "guide/kto_data.yml", "guide/dpo.yml"}
    assert {p.relative_to(NEOX).as_posix() for p in NEOX.rglob("*.yml")} <= used


@pytest.fixture(scope="module")
def save_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("local") / "save_only.yml"
    path.write_text('{"save": "checkpoints", "load": "checkpoints", "log_dir": "logs"}\n')
    return path


def paths_of(c: Case, save_only: Path) -> list[Path]:
    return [save_only if f == SAVE_ONLY else NEOX / f for f in c.files]


def merged_keys(files: list[Path]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path in files:
        merged.update({normalize_key(k): v for k, v in yaml.load(path.read_text(), Loader=SafeLoader).items()})
    return merged


def dry_run(files: list[Path], overrides: tuple[str, ...] = ()) -> tuple[ResolvedConfig, str]:
    """The dry run of ``deepy.py``, raising its one DeepyError; any other exception fails the test."""
    command = parse_command(["--dry-run", str(REPO / "train.py"), *map(str, files), *overrides, *SLURM])
    resolved = resolve(command)
    return resolved, render_dry_run(resolved, command)


def refused_keys(message: str) -> set[str]:
    """The keys a "not supported yet" message lists, one per line before its ``(set: ...)``."""
    head, _, _ = message.partition("\n  (set:")
    return set(re.findall(r"^  (\w+): ", head, re.M))


def without(keys: frozenset[str], files: list[Path], tmp: Path) -> list[Path]:
    """Copies of ``files`` (JSON, which is YAML) with ``keys`` left out."""
    out = []
    for index, path in enumerate(files):
        data = {k: v for k, v in yaml.load(path.read_text(), Loader=SafeLoader).items() if normalize_key(k) not in keys}
        copy = tmp / f"{index}_{path.name}"
        copy.write_text(json.dumps(data, indent=1))
        out.append(copy)
    return out


def assert_passes_as_slurm_launch(resolved: ResolvedConfig, text: str, merged: Mapping[str, Any]) -> None:
    """Passed; every data/tokenizer file it names was only warned about; the ranks' typed configs build."""
    assert text.endswith("deepy: dry run OK, nothing launched")
    for key in PATH_KEYS:
        value = merged.get(key)
        for path in value if isinstance(value, list) else [value] if value else []:
            assert any(str(path) in w and "not readable from this machine" in w for w in resolved.warnings), (key, path)
    fp16 = merged.get("fp16") or {}
    if fp16.get("enabled") and fp16.get("type") != "bfloat16":
        # the device check a local launch makes is skipped, and said so, where this machine cannot answer
        # it for the cluster's devices: on a CPU without fp16 kernels (a CPU with AVX512-FP16/AMX, like
        # some CI machines, runs fp16 itself and needs no skip)
        skipped = any("fp16 support of the devices" in s for s in resolved.skipped)
        assert skipped == (not LAUNCHING_MACHINE.fp16_supported)
    if merged.get("hostfile"):
        assert any(f"hostfile={merged['hostfile']!r} does not exist" in w for w in resolved.warnings)
    RunConfig.from_resolved(resolved)  # what each rank builds from the resolved config


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_neox_config_dry_run(c: Case, save_only: Path) -> None:
    files = paths_of(c, save_only)
    merged = merged_keys(files)
    pending = {k for k in PENDING_KEYS if k in merged}
    expected = set(c.unsupported) | pending
    if not (c.unknown or c.duplicate or expected or c.problems):
        assert_passes_as_slurm_launch(*dry_run(files, c.overrides), merged)
        return
    with pytest.raises(DeepyError) as err:
        dry_run(files, c.overrides)
    message = err.value.message
    if c.problems:
        assert all(part in message for part in c.problems), message
    elif c.unknown:
        assert set(re.findall(r"unknown key '(\w+)'", message)) == c.unknown, message
    elif c.duplicate:
        assert set(re.findall(r"key '(\w+)' is set twice", message)) == c.duplicate, message
    else:
        assert message.startswith("config asks for features Deepy does not support yet:"), message
        assert refused_keys(message) == expected, message


@pytest.mark.parametrize("c", [c for c in CASES if not (c.unsupported or c.unknown or c.duplicate or c.problems)],
                         ids=lambda c: c.id)
def test_neox_config_passes_once_pending_features_land(c: Case, save_only: Path, tmp_path: Path) -> None:
    """With the pending keys left out (what their landing amounts to for a dry run), each passes."""
    files = without(PENDING_KEYS, paths_of(c, save_only), tmp_path)
    assert_passes_as_slurm_launch(*dry_run(files, c.overrides), merged_keys(files))


# --- the configuration guide (configs/README.md): the GPT-3 small example and its data blocks --------
GUIDE = NEOX / "guide"


def guide_config(tmp: Path, *blocks: str, drop: tuple[str, ...] = (), name: str = "gpt3.yml") -> Path:
    """The GPT-3 example with the guide's blocks pasted into it, as one file: keys the blocks repeat
    (data_impl, eval_interval, ...) take the block's value, which is the same."""
    merged: dict[str, Any] = {}
    for name in ("gpt3_small.yml", *blocks):
        merged.update(yaml.load((GUIDE / name).read_text(), Loader=SafeLoader))
    for key in drop:
        merged.pop(key, None)
    path = tmp / name
    path.write_text(json.dumps(merged, indent=1))
    return path


def test_guide_gpt3_example_passes_with_local_setup(tmp_path: Path) -> None:
    files = [GUIDE / "gpt3_small.yml", NEOX / LOCAL]
    pending = {"use_wandb", "tensorboard_dir"} & PENDING_KEYS  # what GPT-NeoX's local_setup.yml sets
    if pending:
        with pytest.raises(ConfigError) as err:
            dry_run(files)
        assert refused_keys(err.value.message) == pending
    else:
        assert_passes_as_slurm_launch(*dry_run(files), merged_keys(files))
    stripped = without(PENDING_KEYS, files, tmp_path)
    assert_passes_as_slurm_launch(*dry_run(stripped), merged_keys(stripped))


def test_guide_gpt3_example_with_its_dataset_block_passes(tmp_path: Path) -> None:
    config = guide_config(tmp_path, "data_setup.yml", drop=tuple(PENDING_KEYS & {"tensorboard_dir"}))
    resolved, text = dry_run([config])
    assert_passes_as_slurm_launch(resolved, text, merged_keys([config]))


def test_guide_kto_block_passes_with_train_impl_kto(tmp_path: Path) -> None:
    """The guide's KTO data block (singular label/reward paths) plus train_impl=kto passes as it stands."""
    config = guide_config(tmp_path, "kto_data.yml", drop=tuple(PENDING_KEYS & {"tensorboard_dir"}))
    resolved, text = dry_run([config], ("train_impl=kto",))
    assert resolved.args.train_impl == "kto"
    assert resolved.args.train_reward_data_paths == ["data/enwik8/enwik8_text_reward_document"]
    assert_passes_as_slurm_launch(resolved, text, merged_keys([config]))


def test_guide_kto_block_singular_keys_become_the_plural_lists(tmp_path: Path) -> None:
    """The KTO block's singular paths load as one-path lists of GPT-NeoX's plural keys."""
    from megatron.neox_arguments.loading import load_config

    args = load_config([str(guide_config(tmp_path, "kto_data.yml", drop=tuple(PENDING_KEYS)))], []).args
    assert args.train_label_data_paths == ["data/enwik8/enwik8_text_label_document"]
    assert args.valid_reward_data_paths == ["data/enwik8/enwik8_text_reward_document"]
    assert args.test_data_paths == ["data/enwik8/enwik8_text_document"]


def test_guide_dpo_block_passes_as_dpo_on_pairwise_data(tmp_path: Path) -> None:
    # "pos/neg data paths instead of a single one": the dataset block without data_path, plus DPO's
    config = guide_config(tmp_path, "data_setup.yml", "dpo.yml",
                          drop=("data_path", *(PENDING_KEYS & {"tensorboard_dir"})))  # fmt: skip
    resolved, text = dry_run([config])
    args = resolved.args
    assert (args.train_impl, args.dataset_impl, args.dpo_beta) == ("dpo", "pairwise", 0.1)
    assert args.neg_train_label_data_paths == ["data/enwik8/enwik8_text_neg_label_document"]
    assert_passes_as_slurm_launch(resolved, text, merged_keys([config]))


# --- GPT-NeoX semantics these configs rely on --------------------------------------------------------
def test_llama_mlp_type_is_swiglu_with_llamas_width(save_only: Path, tmp_path: Path) -> None:
    files = without(PENDING_KEYS, [NEOX / "llama/7B.yml", NEOX / LLAMA_TRAIN, NEOX / LOCAL], tmp_path)
    resolved, _ = dry_run(files)
    model = RunConfig.from_resolved(resolved).model
    # LLaMA-7B: w2(silu(w1 x) * w3 x), 11008 wide (8/3 x 4096 rounded up to 256), no MLP biases
    assert (model.activation, model.ffn_hidden_size, model.use_bias_in_mlp) == ("swiglu", 11008, False)
    assert resolved.provenance["activation"] == "derived"


def test_llama_mlp_type_keeps_a_given_intermediate_size(tmp_path: Path) -> None:
    files = without(PENDING_KEYS, [NEOX / "mistral/7B.yml", NEOX / LLAMA_TRAIN, NEOX / LOCAL], tmp_path)
    model = RunConfig.from_resolved(dry_run(files)[0]).model
    assert (model.activation, model.ffn_hidden_size) == ("swiglu", 14336)


def test_llama_mlp_type_without_a_gated_form_is_refused(tmp_path: Path) -> None:
    files = without(PENDING_KEYS, [NEOX / "llama/7B.yml", NEOX / LLAMA_TRAIN, NEOX / LOCAL], tmp_path)
    with pytest.raises(ConfigError, match=r"mlp_type='llama' .* gates activation='mish'"):
        dry_run(files, ("activation=mish",))
    with pytest.raises(ConfigError, match=r"has no MLP biases, but use_bias_in_mlp=True"):
        dry_run(files, ("use_bias_in_mlp=true",))


def test_guide_max_grad_norm_is_the_gradient_clip(tmp_path: Path) -> None:
    """apex FusedAdam's ``max_grad_norm`` (the guide's optimizer block) is DeepSpeed's clip."""
    config = guide_config(tmp_path, "data_setup.yml", drop=tuple(PENDING_KEYS & {"tensorboard_dir"}))
    alone = guide_config(tmp_path, "data_setup.yml", drop=("gradient_clipping", *PENDING_KEYS & {"tensorboard_dir"}),
                         name="no_clip.yml")
    resolved, _ = dry_run([alone], ("optimizer.params.max_grad_norm=0.25",))
    assert resolved.deepspeed_config["gradient_clipping"] == 0.25
    assert "max_grad_norm" not in RunConfig.from_resolved(resolved).optimizer_config.optimizer_params  # not an Adam argument
    # the command line wins over the file's other spelling (the README's precedence); two files that disagree do not
    resolved, _ = dry_run([config], ("gradient_clipping=0.5",))
    assert resolved.deepspeed_config["gradient_clipping"] == 0.5
    assert any(w.startswith("optimizer.params.max_grad_norm=1.0 (") for w in resolved.warnings)
    clip = tmp_path / "clip.yml"
    clip.write_text("gradient_clipping: 0.5\n")
    with pytest.raises(ConfigError, match=r"max_grad_norm=1.0 .* and gradient_clipping=0.5 .* disagree"):
        dry_run([alone, clip])


def test_deeperspeed_inner_fp16_flag_is_dropped_with_a_warning(tmp_path: Path) -> None:
    files = without(PENDING_KEYS, [NEOX / "19M.yml", NEOX / LOCAL], tmp_path)
    resolved, _ = dry_run(files)
    assert resolved.deepspeed_config["fp16"]["enabled"] is True
    assert "fp16" not in resolved.deepspeed_config["fp16"]
    assert "19M.yml:" in resolved.provenance["fp16"]  # still the user's line, not "derived"
    assert any(w.startswith("fp16.fp16 (") and "changes nothing" in w for w in resolved.warnings)


def test_deeperspeed_inner_fp16_flag_contradicting_enabled_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load((NEOX / "19M.yml").read_text())
    data["fp16"]["fp16"] = False
    config = tmp_path / "19M.yml"
    config.write_text(json.dumps(data))
    files = [config, *without(PENDING_KEYS, [NEOX / LOCAL], tmp_path)]
    with pytest.raises(ConfigError, match=r"fp16\.fp16=False and fp16\.enabled=True .* disagree"):
        dry_run(files)


BF16_LOSS_SCALE = ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale")


def test_rwkv_bf16_block_loss_scale_keys_have_no_effect_and_are_said() -> None:
    """GPT-NeoX's ``configs/rwkv/170M.yml`` (ea7aefd8, the fixture verbatim) writes its bf16 block with the fp16
    block's loss-scale fields. GPT-NeoX hands the block to DeeperSpeed as written (``deepspeed_config``,
    ``megatron/neox_arguments/arguments.py:644-651``; ``bf16`` a plain dict, ``deepspeed_args.py:101``), and
    DeeperSpeed at 91d1c55b (the commit GPT-NeoX's requirements pin) reads only ``bf16.enabled`` (and
    ``immediate_grad_update``) from it, with the scale fixed at 1 for bf16: ``get_bfloat16_enabled``,
    ``get_loss_scale``, ``get_initial_dynamic_scale`` (2**0) and ``get_dynamic_loss_scale_args`` (fp16 only) in
    ``deepspeed/runtime/config.py:167-171, 194-241``. So the run is bf16 with no loss scaling; DeepSpeed 0.19.8's
    ``DeepSpeedBF16Config`` refuses the fields, so they are left out, and the dry run says they have no effect."""
    files = [NEOX / "rwkv/170M.yml", NEOX / LOCAL]
    resolved, text = dry_run(files)
    assert resolved.deepspeed_config["bf16"] == {"enabled": True}  # what DeeperSpeed reads of the block
    assert "fp16" not in resolved.deepspeed_config
    assert resolved.args.precision == "bfloat16"
    said = [w for w in resolved.warnings if "have no effect" in w]
    assert len(said) == 1 and all(f"bf16.{key}" in said[0] for key in BF16_LOSS_SCALE), resolved.warnings
    assert "rwkv/170M.yml:" in said[0] and "no loss scaling" in said[0]
    assert f"warning: {said[0]}" in text  # printed by --dry-run
    # DeepSpeed's own parser takes the translated config (deepy's dry run asked it; asked again here)
    from megatron.neox_arguments.deepspeed_split import _parser_problems

    assert _parser_problems({k: v for k, v in resolved.deepspeed_config.items() if k != "train_batch_size"}, {}) == []
    # an fp16 block's loss-scale fields are DeepSpeed's dynamic loss scaler's settings: passed on unchanged
    resolved, _ = dry_run([NEOX / "19M.yml", NEOX / LOCAL])
    fp16 = resolved.deepspeed_config["fp16"]
    assert (fp16["loss_scale"], fp16["loss_scale_window"], fp16["initial_scale_power"], fp16["hysteresis"],
            fp16["min_loss_scale"]) == (0, 1000, 12, 2, 1)
    assert not any("have no effect" in w for w in resolved.warnings)


def test_pythia_1b_bf16_spelling_says_its_loss_scale_fields_have_no_effect() -> None:
    """Pythia-1B's ``fp16: {type: bfloat16, loss_scale, ...}``: the DeeperSpeed of its time gave that type a loss
    scale of 1 (``deepspeed/runtime/config.py:97-113`` at 996951ef), so the fields had no effect; said."""
    resolved, _ = dry_run([NEOX / "pythia/1B.yml", NEOX / LOCAL])
    assert resolved.deepspeed_config["bf16"] == {"enabled": True} and "fp16" not in resolved.deepspeed_config
    said = [w for w in resolved.warnings if "have no effect" in w]
    assert len(said) == 1 and all(f"fp16.{key}" in said[0] for key in BF16_LOSS_SCALE), resolved.warnings


def test_bf16_inner_flag_without_enabled_is_refused_saying_gpt_neox_runs_fp32(tmp_path: Path) -> None:
    """``bf16: {bf16: true}`` without ``enabled``: DeeperSpeed's ``get_bfloat16_enabled`` reads only ``enabled``
    (default False: ``runtime/constants.py:126-127`` at 91d1c55b), and GPT-NeoX derives its precision from
    ``bf16.get("enabled")`` (``megatron/neox_arguments/arguments.py:974-979`` at ea7aefd8), so GPT-NeoX trains
    it in fp32. Deepy neither guesses bf16 nor runs fp32 behind the user's back: refused, saying both."""
    data = yaml.load((NEOX / "rwkv/170M.yml").read_text(), Loader=SafeLoader)
    del data["bf16"]["enabled"]
    config = tmp_path / "170M.yml"
    config.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"bf16\.bf16=True without bf16\.enabled .* GPT-NeoX trains this config "
                                          r"in fp32; set bf16\.enabled: true for bf16"):
        dry_run([config, NEOX / LOCAL])


# --- the real script: exit codes and no traceback -----------------------------------------------------
def run_deepy(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DEEPY_DEBUG", None)
    return subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"), *argv, *SLURM],
                          cwd=os.getcwd(), env=env, capture_output=True, text=True, timeout=240)  # fmt: skip


def test_script_passes_pythia_14m(save_only: Path) -> None:
    done = run_deepy(str(NEOX / "pythia/14M.yml"), str(save_only))
    assert done.returncode == 0, done.stderr
    assert "deepy: dry run OK, nothing launched" in done.stdout
    assert "not readable from this machine" in done.stdout


def test_script_refuses_an_unbuilt_feature_in_one_message_without_traceback() -> None:
    done = run_deepy(str(NEOX / "1-3B-transformer-engine.yml"), str(NEOX / LOCAL))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.count("deepy: config error:") == 1
    assert all(f"  {key}: " in done.stderr for key in ("te_layernorm_mlp", "te_mha"))
