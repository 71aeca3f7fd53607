"""Shared by the generation and evaluation e2e tests: a tiny char-level corpus, a model config, the
deepy.py runner, and an independent in-process copy of the trained model (plain PyTorch, one
process) to check what the launched ranks computed."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ports import free_port  # noqa: E402  (tests/ports.py: a port range per xdist worker)

REPO = Path(__file__).resolve().parents[2]

MODEL_YML = """\
num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 64
max_position_embeddings: 64
norm: layernorm
pos_emb: rotary
optimizer: {type: Adam, params: {lr: 0.005, betas: [0.9, 0.95], eps: 1.0e-8}}
min_lr: 0.0005
lr_decay_style: cosine
warmup: 0.05
train_batch_size: 8
gradient_clipping: 1.0
weight_decay: 0.0
hidden_dropout: 0.0
attention_dropout: 0.0
precision: fp32
train_iters: 60
lr_decay_iters: 60
eval_interval: 1000
eval_iters: 0
seed: 1234
num_workers: 0
log_interval: 20
tokenizer_type: CharLevelTokenizer
data_path: data/corpus_text_document
split: "90,5,5"
save: ckpt
load: ckpt
checkpoint_factor: 60
log_dir: logs
"""

TRAIN_LAYOUT = ("num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=1", "zero_optimization={stage: 1}")
"""dp2 on the pipeline model with ZeRO-1: every other layout loads it through a universal checkpoint."""

_SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a child"]
_VERBS = ["sees", "likes", "finds", "reads", "wants", "takes"]
_OBJECTS = ["the book", "a red ball", "the small house", "an apple", "the old map", "a blue cup"]


def corpus(n_docs: int = 400, seed: int = 7) -> list[str]:
    """Simple sentences a tiny char-level model learns in a few dozen steps (peaked predictions)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(rng.randint(1, 4))]
        docs.append(" ".join(sentences))
    return docs


def write_corpus(tmp: Path) -> str:
    """The corpus as a CharLevelTokenizer MMIDIDX dataset (EOD 0 after each document); its prefix."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
    from megatron.tokenizer.char_level import CharLevelTokenizer

    tok = CharLevelTokenizer()
    prefix = str(tmp / "data" / "corpus_text_document")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), np.uint16)
    for doc in corpus():
        builder.add_item(tok.tokenize(doc) + [tok.eod])
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def deepy(tmp: Path, script: str, *overrides: str, stdin: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """``deepy.py SCRIPT model.yml key=value...`` in ``tmp``; output captured."""
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    run_env.pop("DEEPY_DEBUG", None)
    return subprocess.run(
        [sys.executable, str(REPO / "deepy.py"), str(REPO / script), str(tmp / "model.yml"), *overrides,
         f"master_port={free_port()}"],
        cwd=tmp, env=run_env, input=stdin, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def train(tmp: Path) -> None:
    (tmp / "model.yml").write_text(MODEL_YML)
    write_corpus(tmp)
    proc = deepy(tmp, "train.py", *TRAIN_LAYOUT)
    assert proc.returncode == 0, output(proc)[-4000:]


# --- the trained model, rebuilt in this process ---------------------------------------------------
def model_config(padded_vocab_size: int = 512) -> Any:
    from megatron.model import GPTConfig

    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                     norm="layernorm", pos_emb="rotary", padded_vocab_size=padded_vocab_size, seed=1234)


def checkpoint_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """`GPTModel` weights from a tp1 pipeline checkpoint: DeepSpeed writes one file per pipeline layer
    in GPT-NeoX's numbering and names (read back by the reader `tests/unit/test_neox_layout.py` checks
    against files built from GPT-NeoX's published rules)."""
    from megatron.checkpointing.neox import NeoxNames, canonical_rank_weights

    names = NeoxNames.from_config(model_config())
    return canonical_rank_weights(ckpt_dir, names, tp=1, tp_rank=0, pipeline=True)


def reference_model(ckpt_dir: Path) -> Any:
    """The trained model as a single-process `GPTModel` (no DeepSpeed, no process group)."""
    from megatron.model import GPTModel

    model = GPTModel(model_config())
    missing, unexpected = model.load_state_dict(checkpoint_state_dict(ckpt_dir), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


def hf_model(model: Any) -> Any:
    """The same network as `transformers.GPTNeoXForCausalLM`, built here from our weights.

    Our fused QKV rows are [all q heads; all k heads; all v heads]; GPT-NeoX's HF layout is per
    head [q_h; k_h; v_h]. Rotary (half split, all dims), layernorm, exact GELU and the tied output
    are the same functions on both sides."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = model.config
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=c.padded_vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.ffn_hidden_size, hidden_act="gelu",
        rotary_pct=1.0, rotary_emb_base=10000, max_position_embeddings=c.max_position_embeddings,
        layer_norm_eps=c.layernorm_epsilon, use_parallel_residual=False, tie_word_embeddings=False,
        attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )).eval()  # fmt: skip
    ours = model.state_dict()
    n, d, h = c.num_attention_heads, c.head_dim, c.hidden_size

    def per_head(fused: torch.Tensor) -> torch.Tensor:
        q, k, v = fused.split(n * d, dim=0)
        parts = [x.reshape(n, d, *x.shape[1:]) for x in (q, k, v)]
        return torch.stack(parts, dim=1).reshape(3 * n * d, *fused.shape[1:])

    head = "lm_head.weight" if "lm_head.weight" in hf.state_dict() else "embed_out.weight"  # transformers 5 / 4
    mapped = {"gpt_neox.embed_in.weight": ours["embedding.word_embeddings.weight"],
              head: ours["embedding.word_embeddings.weight"],
              "gpt_neox.final_layer_norm.weight": ours["final_norm.weight"],
              "gpt_neox.final_layer_norm.bias": ours["final_norm.bias"]}
    for i in range(c.num_layers):
        src, dst = f"layers.{i}.", f"gpt_neox.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "attention.dense", "mlp.dense_h_to_4h",
                     "mlp.dense_4h_to_h"):
            for field in ("weight", "bias"):
                mapped[f"{dst}{name}.{field}"] = ours[f"{src}{name}.{field}"]
        for field in ("weight", "bias"):
            mapped[f"{dst}attention.query_key_value.{field}"] = per_head(ours[f"{src}attention.query_key_value.{field}"])
    hf.load_state_dict(mapped, strict=True)
    return hf
