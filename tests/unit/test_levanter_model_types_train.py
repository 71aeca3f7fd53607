"""Levanter's model types of issue 49 (``qwen``, ``qwen3``, ``olmo2``, ``gemma``, ``gemma2``, ``gemma3``) load from a
Levanter config and train: the config goes through the dialect, the checks before launch and the trainer's engine
(``build_engine``, DeepSpeed, one gloo rank), and the trainer's own step (``train_step``) lowers the loss on a batch
it sees again. What each type builds is checked against transformers' and Levanter's models in test_qwen3,
test_olmo2 and test_gemma; here, that the built engine holds that block (its norms and query/key norms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

LEVANTER = """\
data:
  train_urls: ["{{root}}/train.jsonl"]
  cache_dir: "{{root}}/cache"
  tokenizer: "{{root}}/tokenizer.json"
model:
  type: {kind}
  seq_len: 16
  hidden_dim: 32
  intermediate_dim: 48
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
trainer:
  train_batch_size: 2
  num_train_steps: 4
  mp: p=f32
optimizer:
  learning_rate: 3e-3
  warmup: 0.0
"""
# the block each type builds, by its modules in layer 0: (a norm after attention, q/k norms, gains shifted by one)
BLOCKS = {"qwen": (False, False), "qwen3": (False, True), "olmo2": (True, True), "gemma": (False, False),
          "gemma2": (True, False), "gemma3": (True, True)}



@pytest.mark.parametrize("kind", list(BLOCKS))
def test_a_levanter_model_type_loads_and_trains(kind: str, one_rank: Any, tmp_path: Path) -> None:
    from test_dialects import levanter_args

    from megatron.config_rules import Device
    from megatron.engine.build import build_engine
    from megatron.neox_arguments.derived import finalize
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.training.step import train_step

    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(40)}}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "train.jsonl").write_text('{"text": "w1 w2 w3"}\n')
    resolved = levanter_args(tmp_path, LEVANTER.format(kind=kind))
    tokenizer.save(str(tmp_path / "tokenizer.json"))  # levanter_args wrote a placeholder
    run = RunConfig.from_resolved(finalize(resolved, 1, device=Device(cuda=False, fp16_supported=False)))
    eng = build_engine(run, run.model.with_vocab(64), 4)
    layer = dict(eng.engine.module.named_modules())
    post_norm, qk_norm = BLOCKS[kind]
    assert ("layers.0.attention_output_norm" in layer) == post_norm, kind
    assert ("layers.0.attention.q_norm" in layer and layer["layers.0.attention.q_norm"] is not None) == qk_norm
    gen = torch.Generator().manual_seed(0)
    batch = {"text": torch.randint(0, 64, (2, 17), generator=gen)}
    losses = [float(train_step(eng, iter([batch]), torch.device("cpu")).loss) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.05, losses
