"""Documents of a packed sample kept apart under tp=2 and pp=2, on 2 real gloo ranks.

For every document of a packed batch, its summed loss and every gradient this rank holds must be
those of the same model run on the document alone (fp32, 1e-5): the document mask splits attention
per document on each tensor-parallel rank (heads are split, documents are not), and under a
pipeline the document ids travel with the hidden state from stage to stage. One spawn for both
layouts; tests/unit/test_document_mask.py checks a single rank.
"""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_harness import finish_rank, record_checks, run_ranks

WORLD = 2
EOD = 0
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, padded_vocab_size=64, seed=5)
CONFIGS: dict[str, dict[str, Any]] = {
    "learned": dict(),
    "rotary_gqa": dict(pos_emb="rotary", num_kv_heads=2, activation="swiglu", intermediate_size=384),
    "alibi_window_sequence_parallel": dict(pos_emb="alibi", sliding_window_width=4, sequence_parallel=True),
}
LENGTHS = [[6, 10, 8, 6], [12, 14]]  # even pieces: sequence parallelism splits each in two


def _text(seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for row in LENGTHS:
        docs = [torch.randint(1, 64, (n,), generator=gen) for n in row]
        for doc in docs:
            doc[-1] = EOD
        rows.append(torch.cat(docs)[: seq + 1])
    return torch.stack(rows)


def _cases(cfg) -> list[tuple[Any, torch.Tensor, tuple[int, int, int]]]:
    """(packed micro-batch, this document's labels in it, (row, start, end)) per document."""
    from megatron.model.documents import document_spans
    from megatron.objectives import ObjectiveArgs, build_objective

    obj = build_objective(ObjectiveArgs(reset_attention_mask=True, reset_position_ids=True), eod_token=EOD)
    batch = obj.prepare({"text": _text(cfg.seq_length)})
    cases = []
    for row, spans in enumerate(document_spans(batch.document_ids)):
        for a, e in spans:
            labels = torch.full_like(batch.labels, -100)
            labels[row, a:e] = batch.labels[row, a:e]
            cases.append((batch, labels, (row, a, e)))
    return cases


def _compare(packed: tuple[torch.Tensor | None, list[torch.Tensor]],
             alone: tuple[torch.Tensor | None, list[torch.Tensor]], what: str) -> None:
    if packed[0] is not None:
        torch.testing.assert_close(packed[0], alone[0], atol=1e-5, rtol=0, msg=lambda m: f"{what} loss: {m}")
    for i, (g1, g2) in enumerate(zip(packed[1], alone[1])):
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=0, msg=lambda m: f"{what} grad {i}: {m}")


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return out


def check_tp2(cfg) -> None:
    from megatron.model import GPTModel
    from megatron.mpu.layers import partial_over_tensor_parallel, sum_partial_grads_over_tensor_parallel
    from megatron.objectives import lm_loss_sum

    model = GPTModel(cfg)
    params = list(model.parameters())

    def run(tokens: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor):  # noqa: ANN202
        loss, _ = lm_loss_sum(model(tokens, **kwargs), labels)
        loss.backward()
        sum_partial_grads_over_tensor_parallel([p.grad for p in partial_over_tensor_parallel(model)])  # as the trainer
        return loss.detach(), _grads(params)

    for batch, labels, (row, a, e) in _cases(cfg):
        packed = run(batch.inputs, labels, **batch.model_kwargs())
        alone = run(batch.inputs[row : row + 1, a:e], batch.labels[row : row + 1, a:e])
        _compare(packed, alone, f"tp2 document {row}:{a}-{e}")


def check_pp2(cfg) -> None:
    """Two PipelineModule stages, the activation (hidden, position_ids, document_ids) passed by hand."""
    from deepspeed.pipe import PipelineModule

    from megatron import mpu
    from megatron.model import pipeline_layer_specs
    from megatron.objectives import lm_loss_sum

    stage = mpu.get_pipe_parallel_rank()
    pipe = PipelineModule(layers=pipeline_layer_specs(cfg), topology=mpu.get_topology(),
                          loss_fn=lambda out, labels: lm_loss_sum(out, labels)[0],
                          partition_method="type:TransformerLayerPipe")
    params = list(pipe.parameters())

    def run(inputs: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor):  # noqa: ANN202
        tokens = inputs[0] if isinstance(inputs, tuple) else inputs
        shape = (tokens.shape[1], tokens.shape[0], cfg.hidden_size)
        if stage == 0:
            out = pipe(inputs)
            hidden = out[0] if isinstance(out, tuple) else out
            dist.send(hidden.detach().contiguous(), dst=1)
            grad = torch.empty(shape)
            dist.recv(grad, src=1)
            hidden.backward(grad)
            return None, _grads(params)
        hidden = torch.empty(shape)
        dist.recv(hidden, src=0)
        hidden.requires_grad_()
        extras = inputs[1:] if isinstance(inputs, tuple) else ()
        loss = pipe.loss_fn(pipe((hidden, *extras) if extras else hidden), labels)
        loss.backward()
        dist.send(hidden.grad.contiguous(), dst=0)
        return loss.detach(), _grads(params)

    for batch, labels, (row, a, e) in _cases(cfg):
        packed = run(batch.pipe_inputs(), labels)
        alone = run(batch.inputs[row : row + 1, a:e], batch.labels[row : row + 1, a:e])
        _compare(packed, alone, f"pp2 stage {stage} document {row}:{a}-{e}")


def _rank_main(rank: int, out_dir: str) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # PipelineModule reads them
    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import deepspeed

    from megatron import mpu
    from megatron.deepspeed_internals import skip_shared_memory_comm_op
    from megatron.model import GPTConfig

    skip_shared_memory_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    configs = {name: GPTConfig(**{**BASE, **overrides}) for name, overrides in CONFIGS.items()}
    mpu.initialize_model_parallel(WORLD, 1)
    results = record_checks({f"tp2_{name}": lambda cfg=cfg: check_tp2(cfg) for name, cfg in configs.items()})
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, WORLD)
    pipe_configs = {name: cfg for name, cfg in configs.items() if not cfg.sequence_parallel}
    results |= record_checks({f"pp2_{name}": lambda cfg=cfg: check_pp2(cfg) for name, cfg in pipe_configs.items()})
    finish_rank(out_dir, rank, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("document_mask"))


@pytest.mark.parametrize("key", [f"tp2_{n}" for n in CONFIGS] + ["pp2_learned", "pp2_rotary_gqa"])
def test_packed_document_equals_document_alone(results: list[dict[str, str]], key: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[key] == "ok", f"rank {rank}:\n{per_rank[key]}"
