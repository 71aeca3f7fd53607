"""The memory estimate of ``deepy.py --dry-run`` against what DeepSpeed really allocates (2 CPU ranks).

Each rank builds the real engine (``build_engine``) for a small GPT, trains two steps and sums the
storage of every tensor alive on it after the backward and after the optimizer step, minus what
was alive before the engine existed: parameters, gradients, fp32 master weights, optimizer states
(activations are freed by then). The estimate's model-state total must be within 25% of the larger
of the two, at ZeRO-0 and ZeRO-1 with dp2 in fp32, and ZeRO-1 in bf16.
"""

from __future__ import annotations

import gc
import json
import os
import socket
from pathlib import Path

import pytest
from rank_harness import finish_rank, run_ranks

pytestmark = pytest.mark.slow

CASES = {
    "fp32_zero0": {"precision": "fp32", "zero_optimization": {"stage": 0}},
    "fp32_zero1": {"precision": "fp32", "zero_optimization": {"stage": 1}},
    "bf16_zero1": {"precision": "bfloat16", "zero_optimization": {"stage": 1}},
}
MODEL = {
    "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 64,
    "max_position_embeddings": 64, "pos_emb": "rotary", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_iters": 10,
    "use_dummy_dataset": True, "tokenizer_type": "CharLevelTokenizer", "num_gpus": 2,
}  # fmt: skip


def _storages() -> dict[int, int]:
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # meta tensors, tensor subclasses without storage
            continue
    return seen


def _new_bytes(before: dict[int, int]) -> int:
    gc.collect()
    return sum(n for ptr, n in _storages().items() if ptr not in before)


def rank_main(rank: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = Path(out_dir, "port").read_text()
    import torch

    from megatron.initialize import initialize
    from megatron.engine.memory import MemoryLayout, estimate
    from megatron.model import lm_loss
    from megatron.neox_arguments import finalize
    from megatron.neox_arguments.arguments import NeoXArgs
    from megatron.neox_arguments.resolved import ResolvedConfig
    from megatron.config_rules import Device
    from megatron.neox_arguments.run_config import RunConfig
    from megatron.tokenizer import build_tokenizer
    from megatron.engine.build import build_engine

    torch.set_num_threads(1)
    results: dict[str, str] = {}
    initialized = False
    for name, overrides in CASES.items():
        resolved = finalize(ResolvedConfig(args=NeoXArgs(**{**MODEL, **overrides})), 2,
                            device=Device(cuda=False, fp16_supported=False))
        run = RunConfig.from_resolved(resolved)
        if not initialized:
            initialize(run.parallel, run.training.seed)
            initialized = True
        vocab = run.tokenizer.padded(build_tokenizer(run.tokenizer).vocab_size, run.parallel.model_parallel_size)
        gc.collect()
        before = _storages()
        eng = build_engine(run, run.model.with_vocab(vocab), run.training.loop.train_iters or 1)
        engine, measured = eng.engine, []
        b, s = run.training.batch.micro, run.training.seq_length
        generator = torch.Generator().manual_seed(rank)
        for _ in range(2):
            tokens = torch.randint(0, 200, (b, s + 1), generator=generator)
            logits = engine(tokens[:, :-1])
            loss = lm_loss(logits, tokens[:, 1:], torch.ones(b, s))
            engine.backward(loss)
            del logits, loss
            measured.append(_new_bytes(before))  # gradients reduced, optimizer about to step
            engine.step()
            measured.append(_new_bytes(before))
        est = estimate(MemoryLayout.from_run(run, 2, vocab))
        results[name] = json.dumps({"measured": max(measured), "estimate": est.model_states,
                                    "parameters": est.parameters})
        del eng, engine
        gc.collect()
    finish_rank(out_dir, rank, results)


@pytest.fixture(scope="module")
def measurements(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, float]]]:
    out = tmp_path_factory.mktemp("memory")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        (out / "port").write_text(str(sock.getsockname()[1]))
    results = run_ranks(rank_main, 2, out, timeout_s=600)
    return [{k: json.loads(v) for k, v in r.items()} for r in results]


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_within_25_percent_of_measured(case: str, measurements: list[dict[str, dict[str, float]]]) -> None:
    for rank, result in enumerate(measurements):
        got = result[case]
        ratio = got["estimate"] / got["measured"]
        print(f"{case} rank {rank}: estimate {got['estimate'] / 2**20:.2f} MiB, measured "
              f"{got['measured'] / 2**20:.2f} MiB, ratio {ratio:.3f} ({got['parameters']:,.0f} parameters)")
        assert 0.75 <= ratio <= 1.25, (case, rank, got)
