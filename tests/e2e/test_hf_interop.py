"""Export to / import from Hugging Face end to end, on checkpoints written by real `deepy.py` runs.

Two tiny models train 3 steps on dummy data, saving every step:

* Llama style (rmsnorm, SwiGLU, 4 query / 2 key-value heads, untied head) at tp2 x pp2 (4 ranks);
* GPT-NeoX style (layernorm, gelu, 25% rotary, parallel residual, tied head) at dp2 with ZeRO-1,
  without the pipeline wrapper (2 ranks); the same on one rank with ZeRO-3 (which also serves the
  corrupt-file test).

Their step-2 checkpoints are exported to transformers. The strongest check does not involve our
model at all: the transformers model's loss on the step-3 batch must equal the loss the
distributed run itself logged at step 3 (computed from exactly those weights). Then the exports
are imported back (tensor-equal to the originals), one import is fine-tuned through `deepy.py`
(its first loss equals the transformers model's), and `load` pointing at the wrong thing stops
with exit code 2 and a message, touching nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_resume import MODEL_YML, REPO, losses, output
from test_resume import deepy as deepy_run

from megatron.data.dummy_dataset import DummyDataset
from megatron.interop.convert import export_to_hf, import_to_deepy
from megatron.interop.deepy_checkpoint import read_full_checkpoint
from megatron.interop.hf_model import build_gpt_model, fixed_batch
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

pytestmark = pytest.mark.slow

VOCAB = 512  # CharLevelTokenizer's vocabulary, already a multiple of 128 * tp
SEQ = 32
BATCH = 8
# intermediate_size 288: GPT-NeoX's gated width rule gives halves of 96 (HF's intermediate_size)
LLAMA = ("norm=rmsnorm", "activation=swiglu", "num_kv_heads=2", "intermediate_size=288", "no_weight_tying=true",
         "use_bias_in_attn_linear=false", "use_bias_in_mlp=false", "rms_norm_epsilon=1.0e-6")  # fmt: skip
NEOX = ("norm=layernorm", "rotary_pct=0.25", "gpt_j_residual=true")
TP2PP2 = ("num_gpus=4", "model_parallel_size=2", "pipe_parallel_size=2", "zero_optimization={stage: 1}")
DP2_PLAIN = ("num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=0", "zero_optimization={stage: 1}")
ONE_RANK = ("num_gpus=1", "model_parallel_size=1", "pipe_parallel_size=0", "zero_optimization={stage: 1}")
ZERO3 = ("num_gpus=1", "model_parallel_size=1", "pipe_parallel_size=0", "zero_optimization={stage: 3}")
TRAIN = ("hidden_dropout=0.0", "train_iters=3", "lr_decay_iters=3", "save=ckpt", "checkpoint_factor=1", "log_dir=logs")


def deepy(tmp: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return deepy_run(tmp, *overrides, f"master_port={free_port()}", timeout=900)


def train(tmp: Path, *overrides: str) -> Path:
    proc = deepy(tmp, *overrides, *TRAIN)
    assert proc.returncode == 0, output(proc)[-4000:]
    assert sorted(losses(tmp / "logs")) == [1, 2, 3]
    return tmp


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("llama"), *TP2PP2, *LLAMA)


@pytest.fixture(scope="module")
def neox_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the HF saves ride along (rank 0 of two writes <tmp>/hf/step-N while training): they change no number
    return train(tmp_path_factory.mktemp("neox"), *DP2_PLAIN, *NEOX, "hf_save_path=hf", "hf_save_interval=1")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("zero3"), *ZERO3, *NEOX)


def test_zero3_checkpoint_exports_too(zero3_run: Path, tmp_path: Path) -> None:
    """ZeRO-3 model files hold placeholders: the weights come from the optimizer shards."""
    run = zero3_run
    assert not (run / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt").exists()
    report = export_to_hf(run / "ckpt", tmp_path / "hf", iteration=2)
    assert report.max_logit_diff is not None
    logged = losses(run / "logs")[3]
    assert abs(hf_loss(hf_model(tmp_path / "hf"), step_batch(3)) - logged) <= 2e-5 * max(1.0, logged)


def step_batch(step: int) -> torch.Tensor:
    """The global batch of training step `step` (1-based): dummy samples [(step-1)*8, step*8)."""
    data = DummyDataset(10 * BATCH, SEQ, VOCAB, seed=1234)
    return torch.tensor(np.stack([data[i]["text"] for i in range((step - 1) * BATCH, step * BATCH)]))


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@torch.no_grad()
def hf_loss(model: torch.nn.Module, text: torch.Tensor) -> float:
    logits = model(input_ids=text[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, 1:].reshape(-1)))


def export_tool(ckpt: Path, out: Path) -> subprocess.CompletedProcess[str]:
    tool = REPO / "tools" / "ckpts" / "convert_neox_to_hf.py"  # imports this checkout: tests/conftest.py sets PYTHONPATH
    return subprocess.run([sys.executable, str(tool), str(ckpt), str(out)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def exports(llama_run: Path, neox_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf")
    # the GPT-NeoX-style one through the command-line tool, as a user runs it
    proc = export_tool(neox_run / "ckpt" / "global_step2", out / "neox")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote GPTNeoXForCausalLM" in proc.stdout and "verified: max |logits" in proc.stdout
    report = export_to_hf(llama_run / "ckpt", out / "llama", iteration=2)
    assert report.architecture == "LlamaForCausalLM" and report.max_logit_diff is not None
    return {"llama": out / "llama", "neox": out / "neox"}


@torch.no_grad()
def test_hf_saves_while_training_hold_the_checkpoints_model(neox_run: Path, exports: dict[str, Path]) -> None:
    """hf_save_path at interval 1 over 3 steps: Levanter's 0-based steps 1 and 2 (step 0 skipped; the last written
    again, forced: compat/hf_checkpoints.py:1049-1058, trainer.py:99,448-449 at 9263f81e). step-1, written after 2
    steps, loads in transformers with the logits of our model holding the step-2 checkpoint, and is the offline
    export of that checkpoint (tools/ckpts/convert_neox_to_hf.py's path) tensor for tensor."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = neox_run / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["step-1", "step-2"]
    model = AutoModelForCausalLM.from_pretrained(hf / "step-1", local_files_only=True, torch_dtype=torch.float32)
    full = read_full_checkpoint(neox_run / "ckpt", iteration=2)
    tokens = fixed_batch(VOCAB, SEQ)
    ours = build_gpt_model(full.config, full.weights)(tokens)
    assert (model.eval()(input_ids=tokens).logits - ours).abs().max() <= 1e-4
    live, offline = load_file(str(hf / "step-1" / "model.safetensors")), load_file(str(exports["neox"] / "model.safetensors"))
    assert sorted(live) == sorted(offline) and all(torch.equal(live[k], offline[k]) for k in live)
    last = load_file(str(hf / "step-2" / "model.safetensors"))
    assert any(not torch.equal(last[k], live[k]) for k in live)  # written as training went
    assert (hf / "step-1" / "tokenizer.json").is_file()


@pytest.mark.parametrize("style", ["llama", "neox"])
def test_exported_model_reproduces_the_runs_own_loss(style: str, llama_run: Path, neox_run: Path,
                                                     exports: dict[str, Path]) -> None:  # fmt: skip
    run = llama_run if style == "llama" else neox_run
    config = json.loads((exports[style] / "config.json").read_text())
    assert config["vocab_size"] == VOCAB
    if style == "llama":
        assert config["num_key_value_heads"] == 2 and config["intermediate_size"] == 96
        assert not config["tie_word_embeddings"]
    else:
        assert config["use_parallel_residual"] and config["tie_word_embeddings"]
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    model = hf_model(exports[style])
    logged = losses(run / "logs")[3]  # computed by the distributed run from the step-2 weights
    loss = hf_loss(model, step_batch(3))
    assert abs(loss - logged) <= 2e-5 * max(1.0, logged), (loss, logged)
    # and logit by logit against our model holding the merged weights
    full = read_full_checkpoint(run / "ckpt", iteration=2)
    tokens = fixed_batch(VOCAB, SEQ)
    with torch.no_grad():
        delta = (build_gpt_model(full.config, full.weights)(tokens) - model(input_ids=tokens).logits).abs().max()
    assert float(delta) <= 1e-4
    # the tokenizer came along and speaks our ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exports[style])
    assert tokenizer("hé", add_special_tokens=False)["input_ids"] == [104, 195, 169]


def test_ours_to_hf_to_ours_is_lossless(llama_run: Path, neox_run: Path, exports: dict[str, Path],
                                        tmp_path: Path) -> None:  # fmt: skip
    import_to_deepy(exports["llama"], tmp_path / "llama", tp=2, pp=2)
    import_to_deepy(exports["neox"], tmp_path / "neox", tp=1, pp=0)
    # same layout as the original: every model file holds exactly the original tensors
    pairs = [
        (llama_run / "ckpt" / "global_step2", tmp_path / "llama" / "global_step0", "layer_*-model_*-model_states.pt"),
        (neox_run / "ckpt" / "global_step2", tmp_path / "neox" / "global_step0", "mp_rank_00_model_states.pt"),
    ]
    for original, imported, pattern in pairs:
        files = sorted(p.name for p in original.glob(pattern))
        assert files and files == sorted(p.name for p in imported.glob(pattern))
        for name in files:
            a = torch.load(original / name, weights_only=False)
            b = torch.load(imported / name, weights_only=True)
            a, b = a.get("module", a), b.get("module", b)
            assert set(a) == set(b), name
            assert all(torch.equal(a[k], b[k]) for k in a), name


def test_fine_tuning_an_import_starts_from_its_weights(exports: dict[str, Path], tmp_path: Path) -> None:
    imported = import_to_deepy(exports["neox"], tmp_path / "imported", tp=1, pp=0)
    schedule = "\n".join(line for line in MODEL_YML.splitlines() if line.split(":")[0] in {
        "optimizer", "min_lr", "lr_decay_style", "warmup", "train_batch_size", "gradient_clipping", "weight_decay",
        "eval_interval", "eval_iters", "seed", "num_workers", "log_interval", "use_dummy_dataset"})  # fmt: skip
    (tmp_path / "model.yml").write_text(schedule + "\ntrain_iters: 1\nlr_decay_iters: 1\n")
    expected = hf_loss(hf_model(exports["neox"]), step_batch(1))
    stepped = {}
    # the same start at ZeRO-1 on one rank and at ZeRO-3 on two (Levanter's default fsdp_axis), where the module is
    # partitioned before the weights are read (checkpointing/partitioned_load.py)
    for name, layout in (("zero1", ("num_gpus=1", "zero_optimization={stage: 1}")),
                         ("zero3", ("num_gpus=2", "zero_optimization={stage: 3}"))):
        proc = deepy_run(tmp_path, str(imported.config_file), *layout, f"save={name}", "checkpoint_factor=1",
                         f"log_dir={name}_logs", f"master_port={free_port()}", timeout=900)  # fmt: skip
        assert proc.returncode == 0, output(proc)[-4000:]
        assert "weights-only checkpoint (converted)" in output(proc)
        first = losses(tmp_path / f"{name}_logs")[1]
        assert abs(first - expected) <= 2e-5 * max(1.0, expected), (name, first, expected)
        assert (tmp_path / name / "global_step1" / "COMMITTED").exists()
        stepped[name] = read_full_checkpoint(tmp_path / name, iteration=1).weights
    # ZeRO-3's step-1 weights are its fp32 master partitions after one update (read from its optimizer shards):
    # they equal ZeRO-1's only if the masters started from the imported weights. Adam's first step moves each
    # weight by lr·g/(|g|+eps), 1e-2 here (warmup 0.1 of one step: 10 x lr), for a near-zero gradient too, whose
    # sum over two ranks in another order moves a few elements by up to ~1e-5; masters started anywhere else
    # (the seeded initialisation: the import is 2 steps of 1e-2 from it) are off by the size of a step
    assert sorted(stepped["zero3"]) == sorted(stepped["zero1"])
    imported_weights = read_full_checkpoint(imported.checkpoint).weights
    for key, want in stepped["zero1"].items():
        assert (want - imported_weights[key]).abs().max() > 5e-3, key  # the step is large enough to tell
        torch.testing.assert_close(stepped["zero3"][key], want, rtol=0, atol=1e-4, msg=key)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_load_pointing_at_a_gpt_neox_checkpoint_stops_cleanly(tmp_path: Path, neox_run: Path) -> None:
    neox = tmp_path / "neox_ckpt"
    (neox / "global_step20").mkdir(parents=True)
    torch.save({"module": None, "iteration": 20}, neox / "global_step20" / "mp_rank_00_model_states.pt")
    layer = {"word_embeddings.weight": torch.zeros(4, 4)}
    torch.save(layer, neox / "global_step20" / "layer_00-model_00-model_states.pt")
    (neox / "latest").write_text("global_step20")
    before = tree_digest(neox)
    # GPT-NeoX checkpoints load directly; one that does not fit the config stops before any weight
    # changes or anything is written, naming the tensor
    proc = deepy(tmp_path, *ONE_RANK, f"load={neox}", f"save={neox}", "checkpoint_factor=1",
                 "train_iters=1", "lr_decay_iters=1")  # fmt: skip
    text = output(proc)
    assert proc.returncode == 2, text[-3000:]
    assert f"the GPT-NeoX checkpoint {neox / 'global_step20'} does not fit this run's model" in text
    assert "embedding.word_embeddings.weight: checkpoint (4, 4), this config (512, 64)" in text
    assert "Traceback" not in text
    assert tree_digest(neox) == before

    # asked for explicitly, a fresh start ignores `load`: the same first loss as the NeoX run's
    proc = deepy(tmp_path, *ONE_RANK, *NEOX, "hidden_dropout=0.0", f"load={neox}", "load_checkpoint=false",
                 "save=fresh", "checkpoint_factor=1", "train_iters=1", "lr_decay_iters=1",
                 "log_dir=fresh_logs")  # fmt: skip
    assert proc.returncode == 0, output(proc)[-3000:]
    assert "load_checkpoint: false" in output(proc)
    assert abs(losses(tmp_path / "fresh_logs")[1] - losses(neox_run / "logs")[1]) <= 1e-5  # dp1 vs dp2: float noise
    assert tree_digest(neox) == before


def test_a_corrupt_file_in_a_committed_checkpoint_is_named(tmp_path: Path, zero3_run: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(zero3_run / "ckpt", ckpt)
    broken = ckpt / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    broken.write_bytes(broken.read_bytes()[:1000])
    before = tree_digest(ckpt)
    proc = deepy(tmp_path, *ZERO3, *NEOX, f"load={ckpt}", f"save={ckpt}", "checkpoint_factor=1",
                 "train_iters=4", "lr_decay_iters=3")  # fmt: skip  (the checkpoint's schedule: checked before launch)
    text = output(proc)
    assert proc.returncode == 2, text[-3000:]
    assert f"checkpoint file {broken} is corrupt or truncated" in text
    assert "Traceback" not in text
    assert tree_digest(ckpt) == before


# --- GPT-NeoX's checkpoint layout (tests/neox_reference_layout.py: its published rules, in test code) ---------
@pytest.mark.parametrize("style", ["llama", "neox"])
def test_saved_checkpoints_are_gpt_neox_files_key_by_key(style: str, llama_run: Path, neox_run: Path) -> None:
    """A run's own checkpoint (tp2 x pp2 pipeline / dp2 plain) holds exactly the files and tensors
    GPT-NeoX's layout puts there, plus `latest`, `configs/` and client state GPT-NeoX reads."""
    from neox_reference_layout import neox_files

    run, pipeline, tp = (llama_run, True, 2) if style == "llama" else (neox_run, False, 1)
    ckpt = run / "ckpt" / "global_step2"
    full = read_full_checkpoint(ckpt)
    want = neox_files(full.weights, num_layers=2, heads=4, kv_heads=2 if style == "llama" else 4, tp=tp,
                      pipeline=pipeline, llama=style == "llama")
    pattern = "layer_*-model_*-model_states.pt" if pipeline else "mp_rank_*_model_states.pt"
    assert sorted(p.name for p in ckpt.glob(pattern)) == sorted(want)
    for name, tensors in want.items():
        got = torch.load(ckpt / name, weights_only=False)
        got = got if pipeline else got["module"]
        assert sorted(got) == sorted(tensors), name
        assert all(torch.equal(got[k], tensors[k]) for k in tensors), name
    client = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    assert client["iteration"] == 2 and client["args"]["num_layers"] == 2 and len(client["args"]) == 8
    assert (run / "ckpt" / "latest").read_text().strip() == "global_step3"
    resolved = yaml.safe_load((ckpt / "configs" / "resolved.yml").read_text())  # key=value overrides included
    assert (resolved["pipe_parallel_size"], resolved["model_parallel_size"]) == ((2, 2) if pipeline else (0, 1))


def test_export_with_gpt_neox_flags_equals_ours(neox_run: Path, exports: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tool = REPO / "tools" / "ckpts" / "convert_neox_to_hf.py"
    ckpt = neox_run / "ckpt" / "global_step2"
    flags = ["--input_dir", str(ckpt), "--config_file", str(ckpt / "configs" / "resolved.yml"),
             "--output_dir", str(tmp_path / "hf"), "--precision", "auto", "--architecture", "neox"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(tool), *flags], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(exports["neox"] / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    wrong = subprocess.run([sys.executable, str(tool), *flags[:-1], "llama"], capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert wrong.returncode == 2 and "--architecture llama" in wrong.stderr


GPT_NEOX_SOURCES = {
    # Llama style as GPT-NeoX's converter writes it (tag `0`, no configs/), here in pipeline files at tp2,
    # loaded by a plain tp2 run; GPT-NeoX style plain at tp1 (sequential.*), resumed by a pp1 run
    "llama": dict(pipeline=True, tp=2, run=("num_gpus=2", "model_parallel_size=2", "pipe_parallel_size=0",
                                           "finetune=true", "neox_qkv_order=per_rank", *LLAMA)),
    "neox": dict(pipeline=False, tp=1, run=("num_gpus=1", "model_parallel_size=1", "pipe_parallel_size=1", *NEOX)),
}  # fmt: skip


@pytest.mark.parametrize("style", ["llama", "neox"])
def test_load_on_a_gpt_neox_checkpoint_continues_from_its_weights(style: str, llama_run: Path, neox_run: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """`load:` pointing at a GPT-NeoX checkpoint (built by test code from the published layout, from
    another run's weights perturbed) trains on from exactly those weights: with lr 0 the run's own
    checkpoint gives the source model's logits."""
    from neox_reference_layout import neox_files, write_neox_checkpoint

    case = GPT_NEOX_SOURCES[style]
    source = read_full_checkpoint((llama_run if style == "llama" else neox_run) / "ckpt", iteration=2)
    torch.manual_seed(5)
    weights = {k: v + 0.05 * torch.randn_like(v) for k, v in source.weights.items()}
    files = neox_files(weights, num_layers=2, heads=4, kv_heads=2 if style == "llama" else 4, tp=case["tp"],
                       pipeline=case["pipeline"], llama=style == "llama")
    tag = "0" if style == "llama" else "global_step7"
    write_neox_checkpoint(tmp_path / "neox", tag, files, pipeline=case["pipeline"], tp=case["tp"], iteration=7)
    steps = 1 if style == "llama" else 8  # finetune starts at step 0; a resume continues at GPT-NeoX's iteration 7
    proc = deepy(tmp_path, *case["run"], "load=neox", "save=ckpt", "checkpoint_factor=1", f"train_iters={steps}",
                 f"lr_decay_iters={steps}", "optimizer={type: Adam, params: {lr: 0.0}}", "min_lr=0.0",
                 "hidden_dropout=0.0", "log_dir=logs")  # fmt: skip
    assert proc.returncode == 0, output(proc)[-4000:]
    assert sorted(losses(tmp_path / "logs")) == [steps]
    saved = read_full_checkpoint(tmp_path / "ckpt", iteration=steps)
    tokens = fixed_batch(VOCAB, SEQ)
    with torch.no_grad():
        delta = (build_gpt_model(saved.config, saved.weights)(tokens) - build_gpt_model(saved.config, weights)(tokens))
    assert float(delta.abs().max()) <= 1e-5
