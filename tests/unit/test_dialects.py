"""Levanter's and fms-fsdp's configs and flags become the GPT-NeoX keys they mean (in-process, no launch).

Expected values come from the dialects' own code (Levanter's config classes at stanford-crfm/levanter
9263f81e, fms-fsdp's ``train_config``, ``main_training_llama.py`` and ``scripts/train.sh`` at
foundation-model-stack/fms-fsdp 5a296afe), written out here by hand, not from our output. Each key family
of Levanter's configs is tried in ``tests/unit/test_levanter_keys.py``, fms-fsdp's variants and data in
``tests/unit/test_fms_dialect.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron.errors import ConfigError, UsageError
from megatron.neox_arguments.dialects import classify, fms, levanter, split_argv
from megatron.neox_arguments.loading import load_config
from megatron.neox_arguments.resolved import load_resolved

REPO = Path(__file__).resolve().parents[2]

# Levanter's Configuration Guide example (docs/Configuration-Guide.md), with local paths for its gs:// URLs
GUIDE = """\
data:
    train_urls:
      - "{root}/train.{{1..2}}.jsonl"
    validation_urls:
      - "{root}/val.jsonl"
    cache_dir: "{root}/cache"
    tokenizer: "{root}/tokenizer.json"
model:
  type: gpt2
  hidden_dim: 768
  num_heads: 12
  num_layers: 12
  seq_len: 1024
  gradient_checkpointing: true
  scale_attn_by_inverse_layer_idx: true
trainer:
  wandb:
    project: "levanter"
    tags: [ "openwebtext", "gpt2"]

  mp: p=f32,c=bfloat16
  model_axis_size: 1
  per_device_parallelism: 4

  train_batch_size: 512
optimizer:
  learning_rate: 6E-4
  weight_decay: 0.1
  min_lr_ratio: 0.1
"""


def write_local_data(root: Path) -> None:
    """What the guide's gs:// URLs hold, here: raw-text jsonl shards and a tokenizer.json."""
    import tokenizers

    # 256 entries: no vocabulary padding at tp 1 or 2 (padded rows would enter the softmax differently)
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(254)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    for name in ("train.1", "train.2", "val"):
        rows = [{"text": " ".join(f"w{(i * 7 + j) % 30}" for j in range(40))} for i in range(20)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def levanter_args(tmp_path: Path, text: str, *flags: str, overrides: tuple[str, ...] = ()) -> Any:
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(text.format(root=tmp_path))
    _, parsed = split_argv(["--config_path", str(config), *flags])
    return load_config([], overrides, None, parsed)


def fms_args(*flags: str, files: tuple[str, ...] = ()) -> Any:
    _, parsed = split_argv(list(flags))
    return load_config(list(files), (), None, parsed)


# ----------------------------------------------------------------------------------------- Levanter


def test_guide_example_means_what_levanter_says(tmp_path: Path) -> None:
    resolved = levanter_args(tmp_path, GUIDE, "--trainer.num_train_steps", "10", "--trainer.id=run7")
    a = resolved.args
    assert (a.hidden_size, a.num_attention_heads, a.num_layers, a.seq_length) == (768, 12, 12, 1024)
    assert a.max_position_embeddings == 1024
    assert a.checkpoint_activations and a.scale_attn_by_inverse_layer_idx
    # gpt2: learned positions, LayerNorm, GPT-2's tanh GELU (gelu_new), tied embeddings
    assert (a.pos_emb, a.norm, a.activation, a.no_weight_tying) == ("learned", "layernorm", "gelu_tanh", False)
    assert a.precision == "bfloat16"  # c=bfloat16, master params fp32
    assert (a.model_parallel_size, a.train_micro_batch_size_per_gpu, a.train_batch_size) == (1, 4, 512)
    assert (a.lr, a.weight_decay, a.levanter_min_lr_ratio) == (6e-4, 0.1, 0.1)
    assert (a.lr_decay_style, a.levanter_lr_schedule, a.seed) == ("levanter", "cosine", 0)  # Levanter's curve
    assert a.train_iters == 10
    assert a.train_urls == [f"{tmp_path}/train.{{1..2}}.jsonl"] and a.validation_urls == [f"{tmp_path}/val.jsonl"]
    assert a.cache_dir == f"{tmp_path}/cache"
    assert (a.tokenizer_type, a.vocab_file) == ("HFTokenizer", f"{tmp_path}/tokenizer.json")
    tracker = a.tracker.model_dump()
    assert (tracker["type"], tracker["project"], tracker["tags"], tracker["id"]) == ("wandb", "levanter",
                                                                                   ["openwebtext", "gpt2"], "run7")
    # provenance: the file and line of the dialect key, and the key itself
    assert resolved.provenance["num_layers"] == f"{tmp_path}/run.yaml:12 (levanter model.num_layers)"
    assert resolved.provenance["train_iters"] == "--trainer.num_train_steps 10 (levanter trainer.num_train_steps)"


def test_levanter_defaults_where_gpt_neox_differs(tmp_path: Path) -> None:
    """TrainerConfig, AdamConfig/OptimizerConfig and LlamaConfig's defaults (not the doc table's)."""
    a = levanter_args(tmp_path, "model:\n  type: llama\n  num_layers: 2\n  hidden_dim: 64\n  num_heads: 4\n"
                                "  num_kv_heads: 4\n  intermediate_dim: 128\n  seq_len: 32\n").args
    assert (a.seed, a.weight_decay, a.lr, a.lr_decay_style) == (0, 0.1, 6e-4, "levanter")
    assert (a.levanter_warmup, a.levanter_min_lr_ratio, a.levanter_lr_schedule) == (0.01, 0.1, "cosine")
    assert (a.train_iters, a.train_batch_size, a.eval_interval) == (400_000, 512, 1000)
    params = a.optimizer.model_dump()["params"]
    assert (params["betas"], params["eps"], a.gradient_clipping) == ((0.9, 0.95), 1e-8, 1.0)
    # llama: rotary, RMSNorm, SwiGLU, untied output, no biases
    assert (a.pos_emb, a.norm, a.activation, a.no_weight_tying) == ("rotary", "rmsnorm", "swiglu", True)
    assert not (a.use_bias_in_attn_linear or a.use_bias_in_mlp or a.use_bias_in_norms)
    # Levanter's intermediate_dim is each half's width: GPT-NeoX's intermediate_size 3 x 128 gives it
    assert (a.num_kv_heads, a.ffn_hidden_size, a.intermediate_size, a.rms_norm_epsilon) == (4, 128, 384, 1e-5)


def test_include_per_section_and_both_flag_spellings(tmp_path: Path) -> None:
    (tmp_path / "data.yaml").write_text(f"train_urls: [{tmp_path}/a.jsonl]\ncache_dir: {tmp_path}/c\n")
    text = "data: !include data.yaml\nmodel:\n  num_layers: 2\ntrainer:\n  num_train_steps: 5\n"
    resolved = levanter_args(tmp_path, text, "--trainer.num_train_steps=7", "--optimizer.beta2", "0.95",
                             "--model.hidden_dim", "64")
    a = resolved.args
    assert a.train_urls == [f"{tmp_path}/a.jsonl"] and a.cache_dir == f"{tmp_path}/c"
    assert resolved.provenance["train_urls"].startswith(f"{tmp_path}/data.yaml:1 ")  # the included file's line
    assert a.train_iters == 7  # the flag wins over the file, as in draccus
    assert a.optimizer.model_dump()["params"]["betas"] == (0.9, 0.95)
    assert a.hidden_size == 64 and a.num_layers == 2


def test_checkpointer_and_resume_keys(tmp_path: Path) -> None:
    text = ("trainer:\n  id: abc\n  checkpointer:\n    base_path: out\n    save_interval: 15min\n"
            "    keep:\n      - every: 1000\n        until: 10000\n      - every: 5000\n")
    a = levanter_args(tmp_path, text).args
    assert (a.save, a.load) == ("out/abc", "out/abc")  # Levanter's run-id subdirectory, resumed from there
    assert a.save_interval == "15min" and a.keep == [{"every": 1000, "until": 10000}, {"every": 5000}]
    b = levanter_args(tmp_path, text, "--trainer.load_checkpoint_path", "old/abc", "--trainer.wandb.resume", "true",
                      "--trainer.wandb.mode", "offline").args
    assert (b.save, b.load) == ("out/abc", "old/abc")
    assert b.tracker.model_dump()["id"] == "abc" and b.tracker.model_dump()["mode"] == "offline"


@pytest.mark.parametrize(("policy", "precision"), [("p=f32,c=bfloat16", "bfloat16"), ("f32", "fp32"),
                                                    ("params=float32,compute=float16", "fp16")])
def test_mixed_precision_policies(tmp_path: Path, policy: str, precision: str) -> None:
    assert levanter_args(tmp_path, f"trainer:\n  mp: {policy}\n").args.precision == precision


def test_bf16_params_keep_no_fp32_copy(tmp_path: Path) -> None:
    """p=bf16,c=bf16 is jmp's one-dtype bf16 policy (test_levanter_keys.py checks it as ``bfloat16``)."""
    args = levanter_args(tmp_path, "trainer:\n  mp: p=bf16,c=bf16\n").args
    assert args.bf16["bf16_master_weights_and_grads"] and args.bf16["bf16_optimizer_states"]
    with pytest.raises(ConfigError, match=r"trainer.mp .*p=f32"):
        levanter_args(tmp_path, "trainer:\n  mp: p=f16,c=f16\n")


def test_remote_urls_are_refused_by_key_and_line(tmp_path: Path) -> None:
    """A download (http(s)://, hf://) is refused for every key; a bucket only where Deepy does not read or write one
    (gs:// train_urls are read through gcsfs, a requirement: not refused; an uninstalled scheme's package is named,
    test_object_store.py)."""
    with pytest.raises(ConfigError) as err:
        levanter_args(tmp_path, 'data:\n  train_urls: ["gs://b/x.jsonl.gz"]\n  cache_dir: "gs://b/c"\n'
                      '  validation_urls: ["https://example.com/v.jsonl"]\n')
    message = err.value.message
    assert "data.train_urls at" not in message and "gs://b/x.jsonl.gz" not in message
    assert (f"data.cache_dir at {tmp_path}/run.yaml:3: gs://b/c is in object storage; Deepy reads data.cache_dir on "
            "this machine - give a local path") in message
    assert f"data.validation_urls at {tmp_path}/run.yaml:4: https://example.com/v.jsonl is a remote URL" in message
    assert "downloads nothing" in message
    with pytest.raises(ConfigError, match=rf"trainer.checkpointer.base_path at {tmp_path}/run.yaml:3: "
                                          r"https://example.com/c is a remote URL.*downloads nothing"):
        levanter_args(tmp_path, 'trainer:\n  checkpointer:\n    base_path: "https://example.com/c"\n')


def test_object_store_paths_of_levanter_and_fms_fsdp_pass_through(tmp_path: Path, s3_server: Any) -> None:
    """Levanter's checkpointer.base_path and fms-fsdp's ckpt_save_path/data_path on a bucket become Deepy's save,
    load and data paths there (checked, and the buckets probed, before launch: tests/unit/test_object_store.py);
    an unknown scheme is still refused by key and line."""
    s3_server.bucket("deepy-dialects")
    args = levanter_args(tmp_path, 'trainer:\n  id: run9\n  checkpointer:\n    base_path: "s3://deepy-dialects/lev"\n'
                         'hf_save_path: "s3://deepy-dialects/hf"\n').args
    assert args.save == args.load == "s3://deepy-dialects/lev/run9"
    assert args.hf_save_path == "s3://deepy-dialects/hf/run9"
    with pytest.raises(ConfigError, match=rf"trainer.checkpointer.base_path at {tmp_path}/run.yaml:4: .*s3x://"):
        levanter_args(tmp_path, 'trainer:\n  checkpointer:\n    save_interval: 10min\n    base_path: "s3x://b/c"\n')
    resolved = fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=True", "--vocab_size=256",
                        "--ckpt_save_path=s3://deepy-dialects/fms", "--ckpt_load_path=s3://deepy-dialects/fms")
    assert resolved.args.save == resolved.args.load == "s3://deepy-dialects/fms/checkpoints"
    resolved = fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=False", "--data_path=s3://deepy-dialects/d",
                        "--datasets=a,b", "--weights=1,1", "--ckpt_save_path=s3://deepy-dialects/fms2")
    assert resolved.args.train_data_paths == ["s3://deepy-dialects/d/a", "s3://deepy-dialects/d/b"]


def test_data_in_a_bucket_passes_through_levanter_and_fms_fsdp(tmp_path: Path) -> None:
    """Levanter's train_urls/validation_urls and fms-fsdp's data_path may name a bucket (the ranks download them:
    tests/unit/test_remote_data.py); nothing is probed at translation, so no server is needed. An unknown scheme
    is refused by the flag, and a local-only key keeps refusing a bucket, naming the keys that take one."""
    args = levanter_args(tmp_path, 'data:\n  train_urls: ["s3://deepy-d/t-{{1,2}}.jsonl"]\n'
                         '  validation_urls: ["s3://deepy-d/v.jsonl"]\n  cache_dir: "{root}/cache"\n').args
    assert args.train_urls == ["s3://deepy-d/t-{1,2}.jsonl"] and args.validation_urls == ["s3://deepy-d/v.jsonl"]
    assert args.cache_dir == f"{tmp_path}/cache"
    with pytest.raises(ConfigError, match=r"data.cache_dir at .*run.yaml:2: s3://deepy-d/c is in object storage; "
                                          r"Deepy reads data.cache_dir on this machine - give a local path \(of the "
                                          r"levanter keys, trainer.checkpointer.base_path, .*data.train_urls"):
        levanter_args(tmp_path, 'data:\n  cache_dir: "s3://deepy-d/c"\n')
    resolved = fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=False", "--data_path=s3://deepy-d/tokens",
                        "--datasets=web", "--weights=1")
    assert resolved.args.train_data_paths == ["s3://deepy-d/tokens/web"]
    with pytest.raises(ConfigError, match=r"fms-fsdp key data_path at --data_path.*: s3x://deepy-d/tokens: Deepy "
                                          r"cannot read or write s3x://"):
        fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=False", "--data_path=s3x://deepy-d/tokens",
                 "--datasets=web", "--weights=1")


@pytest.mark.parametrize("key", sorted(levanter.REFUSED))
def test_levanter_keys_without_meaning_are_refused_by_name(tmp_path: Path, key: str) -> None:
    section = key.split(".")[0] if "." in key else "trainer"
    with pytest.raises(ConfigError, match=rf"levanter key {key.replace('.', '[.]')}(\.\w+)? at .*has no meaning in Deepy"):
        levanter_args(tmp_path, f"{section}:\n  placeholder_for_structure: null\n", f"--{key}", "x")


def test_unknown_levanter_key_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown levanter key trainer.num_train_step at .*run.yaml:2; did you mean: "
                                          r"trainer.num_train_steps"):
        levanter_args(tmp_path, "trainer:\n  num_train_step: 3\n")


# ---------------------------------------------------------------------------------------- fms-fsdp

TRAIN_SH = ("--use_dummy_dataset={dummy}", "--ckpt_load_path={root}/ckpt", "--ckpt_save_path={root}/ckpt",
            "--data_path={root}/data", "--fsdp_activation_checkpointing=False", "--selective_checkpointing=1",
            "--sharding_strategy=hsdp", "--low_cpu_fsdp=False", "--batch_size=2", "--report_interval=200",
            "--checkpoint_interval=20000", "--use_torch_compile=False", "--use_profiler=False")
"""fms-fsdp's scripts/train.sh flags (local paths)."""


@pytest.mark.parametrize("dummy", [True, False])
def test_fms_train_sh_flags(tmp_path: Path, dummy: bool) -> None:
    flags = [f.format(dummy=dummy, root=tmp_path) for f in TRAIN_SH]
    a = fms_args(*flags, "--model_variant=llama_tiny", "--datasets=a,b", "--weights=3,1", "--vocab_size=256").args
    # Checkpointer(ckpt_save_path, ...) keeps its checkpoints in <path>/checkpoints/
    assert (a.load, a.save) == (f"{tmp_path}/ckpt/checkpoints", f"{tmp_path}/ckpt/checkpoints")
    assert a.use_dummy_dataset is dummy
    assert a.train_data_paths == (None if dummy else [f"{tmp_path}/data/a", f"{tmp_path}/data/b"])
    assert a.train_data_weights == (None if dummy else [3.0, 1.0])
    assert (a.dummy_data, a.dummy_data_vocab_size) == (("counter", 256) if dummy else ("uniform", None))
    assert not a.checkpoint_activations and a.selective_checkpointing is None
    assert a.sharding_strategy == "hsdp"
    assert (a.train_micro_batch_size_per_gpu, a.gradient_accumulation_steps) == (2, 1)
    assert (a.log_interval, a.checkpoint_factor, a.compile_layers, a.profile) == (200, 20000, False, False)
    # fms-fsdp's defaults: seed 2023, 3e-4 peak on its warmup-cosine curve, bf16 mixed precision, 4096 tokens
    assert (a.seed, a.lr, a.lr_decay_style, a.train_iters) == (2023, 3e-4, "fms", 1_000_000)
    assert (a.precision, a.seq_length, a.gradient_clipping) == ("bfloat16", 4096, 1.0)
    assert (a.hidden_size, a.num_layers, a.padded_vocab_size) == (64, 2, 8192)


def test_fms_keys_in_a_yaml_file_and_selective_fraction(tmp_path: Path) -> None:
    config = tmp_path / "fms.yaml"
    config.write_text("model_variant: llama_tiny\nuse_dummy_dataset: true\nfsdp_activation_checkpointing: true\n"
                      "selective_checkpointing: 0.5\nnum_steps: 3\n")
    resolved = fms_args("--seq_length=32", "--vocab_size=256", files=(str(config),))
    assert classify({"model_variant": "7b"}) == fms.NAME
    assert resolved.args.checkpoint_activations and resolved.args.selective_checkpointing == 2  # every 2nd block
    assert resolved.args.train_iters == 3 and resolved.args.seq_length == 32
    assert resolved.provenance["train_iters"] == f"{config}:5 (fms-fsdp num_steps)"


@pytest.mark.parametrize("key", sorted(fms.REFUSED))
def test_fms_keys_without_meaning_are_refused_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"fms-fsdp key {key} = .* has no meaning in Deepy|fms-fsdp key {key} at"):
        fms_args("--model_variant=llama_tiny", f"--{key}=1")


# ------------------------------------------------------------------------------ one dialect per run


def test_mixing_dialects_is_one_error(tmp_path: Path) -> None:
    neox = tmp_path / "neox.yml"
    neox.write_text("hidden_size: 64\n")
    with pytest.raises(ConfigError, match=r"mixes config dialects: .*levanter.*gpt-neox|mixes config dialects: .*gpt-neox.*levanter"):
        levanter_args(tmp_path, "trainer:\n  seed: 1\n", overrides=("hidden_size=64",))
    with pytest.raises(ConfigError, match="mixes config dialects"):
        fms_args("--model_variant=llama_tiny", files=(str(neox),))
    with pytest.raises(ConfigError, match="mixes config dialects"):
        levanter_args(tmp_path, "trainer:\n  seed: 1\n", "--num_steps=3")


def test_launch_keys_accompany_any_dialect(tmp_path: Path) -> None:
    local = tmp_path / "local.yml"
    local.write_text("num_gpus: 2\n")
    resolved = levanter_args(tmp_path, "trainer:\n  seed: 1\n", "--num_gpus", "3", overrides=("master_port=29999",))
    assert (resolved.args.num_gpus, resolved.args.master_port) == (3, 29999)
    assert fms_args("--model_variant=llama_tiny", "--use_dummy_dataset=true", "--vocab_size=256",
                    files=(str(local),)).args.num_gpus == 2


def test_unknown_flag_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown flag '--model_varient=7b'; did you mean: --model_variant"):
        fms_args("--model_varient=7b")


# ------------------------------------------------------------------------- dry run and the record


def test_dry_run_shows_each_dialect_key_and_what_it_became(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron.app.deepy import main

    write_local_data(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(GUIDE.format(root=tmp_path))
    assert main(["--dry-run", str(REPO / "train.py"), "--config_path", str(config), "--trainer.num_train_steps",
                 "10", "--model.num_layers=2", "--num_gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "levanter keys and the GPT-NeoX keys they became:" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "--model.num_layers=2" in lines["model.num_layers"] and "-> num_layers=2" in lines["model.num_layers"]
    assert f"{config}:21" in lines["trainer.mp"] and 'precision="bfloat16"' in lines["trainer.mp"]
    assert "train_iters=10" in lines["trainer.num_train_steps"]


def test_resolved_file_records_the_dialect_and_the_gpt_neox_args(tmp_path: Path) -> None:
    resolved = levanter_args(tmp_path, GUIDE, "--trainer.num_train_steps", "10")
    path = resolved.write(tmp_path / "deepy_config.json")
    back = load_resolved(path)
    assert back.dialect["name"] == "levanter"
    assert {"key": "trainer.num_train_steps", "where": "--trainer.num_train_steps 10",
            "neox": {"train_iters": 10}} in back.dialect["rows"]
    assert back.args.train_iters == 10 and back.args.hidden_size == 768
    assert json.loads(path.read_text())["args"]["scale_attn_by_inverse_layer_idx"] is True


def test_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  model_averaging:\n    type: ema_decay_sqrt\n    beta: 0.995\n")
    proc = subprocess.run([sys.executable, str(REPO / "deepy.py"), "--dry-run", str(REPO / "train.py"),
                           "--config_path", str(config)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"levanter key trainer.model_averaging = {{'type': 'ema_decay_sqrt', 'beta': 0.995}} at {config}:2: model averaging" \
        in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_dialect_commands_of_the_docs_resolve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/dialects.md's Levanter and fms-fsdp commands, as written (my-run.yaml: the guide's example),
    pass every check of a launch (--dry-run); one rank here."""
    from megatron.app.deepy import main, parse_command, resolve

    text = (REPO / "docs" / "dialects.md").read_text()
    joined = text.replace("\\\n", " ")  # a command continued over lines with a backslash
    commands = [line.split("python deepy.py train.py ")[1] for line in joined.splitlines()
                if line.startswith("python deepy.py train.py --")]
    assert len(commands) == 2
    write_local_data(tmp_path)
    (tmp_path / "my-run.yaml").write_text(GUIDE.format(root=tmp_path))
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = ["--dry-run", str(REPO / "train.py"), *command.split(), "--num_gpus", "1"]
        try:
            assert main(argv) == 0, command
        except ConfigError as err:
            # fms-fsdp's llama3_8b is sized for a GPU node: where this machine's memory is smaller (its CPU rank
            # would hold the whole model) the memory estimate refuses the launch; every other check passes
            assert "on this machine =" in err.message and "allow_memory_overcommit" in err.message, err.message
            resolve(parse_command(argv))
    assert "deepy: dry run OK" in capsys.readouterr().out


def test_docs_map_every_dialect_key() -> None:
    """docs/dialects.md names every key the dialects accept or refuse."""
    text = (REPO / "docs" / "dialects.md").read_text()
    missing = []
    for key in [*levanter.RULES, *levanter.REFUSED, *fms.RULES, *fms.REFUSED]:
        parent, _, field = key.rpartition(".")
        grouped = f"`{parent}.{{" in text and field in text  # `trainer.wandb.{project, ...}`
        if f"`{key}`" not in text and not grouped:
            missing.append(key)
    assert missing == [], f"docs/dialects.md does not map: {missing}"
