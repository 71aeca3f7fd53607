"""``deepy.py --rehearse N``: a launch of N ranks checked and shown on this 2-core machine (docs/rehearsal.md).

The references are independent of the rehearsal's code:

* GPT-NeoX-20B and LLaMA-2-70B at tp 8 x pp 8 x dp 16 = 1,024 ranks: each rank's parameters from the
  architecture's parameter formula with the tensor-parallel split and the pipeline's layer split written out
  here (the split is DeepSpeed's ``partition_balanced``, asked directly), the bytes each rank holds from
  DeepSpeed's padding rule written out, and the whole models' published parameter counts;
* the ZeRO layout against the optimizers DeepSpeed itself builds (``deepspeed.initialize`` on torch's fake
  process group at dp 4, in a subprocess: DeepSpeed keeps process-group state in its modules);
* the tensor-parallel collectives of a block, the embedding and the logits counted by torch's ``CommDebugMode``
  while they run on the meta device.

Both 1,024-rank rehearsals run at once, in one subprocess each, once for the module; each must take under the
two minutes the rehearsal promises.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/gpt_configs.py

from gpt_configs import gpt_config  # noqa: E402

WORLD, TP, PP, DP = 1024, 8, 8, 16
NO_DATA = ["use_dummy_dataset=true", "tokenizer_type=CharLevelTokenizer", "checkpoint_factor=null"]
RUNS = {
    # GPT-NeoX-20B's tokenizer (50,277 tokens) padded as GPT-NeoX pads it at tp 8: to a multiple of 128 x 8
    "20B": ["configs/20B.yml", *NO_DATA, "padded_vocab_size=51200", "model_parallel_size=8", "pipe_parallel_size=8"],
    # LLaMA-2's SPM vocabulary: 32,000 (make_vocab_size_divisible_by: 1 in the file)
    "70B": ["configs/llama2/70B.yml", *NO_DATA, "padded_vocab_size=32000", "pipe_parallel_size=8"],
}
TIME_LIMIT_S = 120.0


@dataclass(frozen=True)
class Done:
    code: int
    out: str
    seconds: float


def _deepy(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "deepy.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def rehearsals() -> dict[str, Done]:
    started = {name: (time.perf_counter(), _deepy("--rehearse", str(WORLD), "train.py", *args))
               for name, args in RUNS.items()}
    done = {}
    for name, (start, proc) in started.items():
        out, _ = proc.communicate(timeout=600)
        done[name] = Done(proc.returncode, out, time.perf_counter() - start)
    return done


# --- the references ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One pipeline stage's parameters on one tp rank: decayed (matrices) and not (biases, norms)."""

    blocks: int
    decay: int
    no_decay: int

    @property
    def parameters(self) -> int:
        return self.decay + self.no_decay


def neox_20b_stage(blocks: int, first: bool, last: bool) -> Stage:
    """GPT-NeoX-20B per tp rank: h 6144, a 4h GELU MLP, biases everywhere, two LayerNorms per block (weight and
    bias); tp splits the qkv, dense, h->4h and 4h->h matrices and the column-parallel biases (qkv, h->4h), the
    row-parallel biases (dense, 4h->h) and the norms are whole on every rank; untied vocab-parallel embedding and
    output layer of 51,200 rows, a final LayerNorm."""
    h, v, t = 6144, 51200, TP
    matrices = (3 * h * h + h * h + 4 * h * h + 4 * h * h) // t
    vectors = (3 * h + 4 * h) // t + h + h + 2 * 2 * h
    decay = blocks * matrices + (v // t * h if first else 0) + (v // t * h if last else 0)
    no_decay = blocks * vectors + (2 * h if last else 0)
    return Stage(blocks, decay, no_decay)


def llama2_70b_stage(blocks: int, first: bool, last: bool) -> Stage:
    """LLaMA-2-70B per tp rank: h 8192, 64 query heads of 128 and 8 key/value heads (qkv is h x (h + 2 x 1024)),
    a SwiGLU MLP of 28,672 (gate and up, then down), no biases, two RMSNorm weights per block (whole on every
    rank); untied embedding and output layer of 32,000 rows, a final RMSNorm."""
    h, kv, ffn, v, t = 8192, 8 * 128, 28672, 32000, TP
    matrices = (h * (h + 2 * kv) + h * h + 2 * ffn * h + ffn * h) // t
    decay = blocks * matrices + (v // t * h if first else 0) + (v // t * h if last else 0)
    no_decay = blocks * 2 * h + (h if last else 0)
    return Stage(blocks, decay, no_decay)


def layer_split(layers: int) -> list[int]:
    """The blocks each of the 8 stages gets: DeepSpeed's ``partition_balanced`` over the layer specs (embedding,
    the blocks, final norm, head) with the blocks weighted 1, as PipelineModule's ``type:`` partition asks it."""
    from deepspeed.runtime.utils import partition_balanced

    parts = partition_balanced(weights=[0] + [1] * layers + [0, 0], num_parts=PP)
    return [int(parts[i + 1] - parts[i]) - (i == 0) - 2 * (i == PP - 1) for i in range(PP)]


SPLITS = {"20B": [6, 6, 6, 6, 5, 5, 5, 5], "70B": [10] * 8}
STAGES = {"20B": neox_20b_stage, "70B": llama2_70b_stage}
PUBLISHED = {
    # GPT-NeoX-20B: 20,554,567,680 with its 50,432-row vocabulary; 768 rows more in the embedding and the head
    "20B": 20_554_567_680 + 2 * 768 * 6144,
    "70B": 68_976_648_192,  # LLaMA-2-70B (Meta's release; transformers' LlamaForCausalLM at its config)
}
STEP = {"20B": dict(m=32, s=2048, b=4, h=6144), "70B": dict(m=64, s=4096, b=1, h=8192)}


def padded(n: int) -> int:
    """DeepSpeed 0.19.8's flat-buffer padding: a multiple of 2 x dp (stage_1_and_2.py:441, bf16_optimizer.py:168)."""
    return math.ceil(n / (2 * DP)) * 2 * DP


def expected_bytes(stage: Stage) -> tuple[int, int, int, int]:
    """(weights, gradients, master weights, optimizer states) of a rank under bf16, ZeRO-1 with fp32 gradient
    accumulation: DeepSpeed's BF16_Optimizer (engine.py:2305-2310) keeps the padded bf16 weights, a whole padded
    fp32 gradient buffer besides the backward's bf16 gradients, and fp32 master weights and Adam's two states for
    its 1/dp part."""
    flat = padded(stage.decay) + padded(stage.no_decay)
    return 2 * flat, 4 * flat + 2 * stage.parameters, 4 * flat // DP, 2 * 4 * flat // DP


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _spans(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out += list(range(int(low), int(high or low) + 1))
    return out


def _section(out: str, title: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip())
    return lines[start + 2:end]  # after the title and the table's header


# --- the 70B config is LLaMA-2-70B -------------------------------------------------------------------------------
def test_the_70b_config_is_llama2_70b_as_transformers_builds_it() -> None:
    """transformers' LlamaForCausalLM at LLaMA-2-70B's sizes (its LlamaConfig defaults elsewhere: rotary base
    10000, untied embeddings, SiLU-gated MLP), built on the meta device and counted: the published
    68,976,648,192, and the widths configs/llama2/70B.yml resolves to."""
    import transformers

    from megatron.neox_arguments import load_config

    llama = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                                     rms_norm_eps=1e-5, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["70B"]
    ours = load_config([str(REPO / "configs/llama2/70B.yml")], []).args
    assert (ours.num_layers, ours.hidden_size, ours.num_attention_heads, ours.num_kv_heads, ours.seq_length) == (
        llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
        llama.max_position_embeddings)
    assert ours.with_vocab(32000).mlp_widths.second == llama.intermediate_size
    assert ours.rotary_emb_base == llama.rope_parameters["rope_theta"] and ours.rms_norm_epsilon == llama.rms_norm_eps
    assert ours.no_weight_tying is not llama.tie_word_embeddings and ours.activation == "swiglu"


def test_a_meta_parameter_draws_nothing_but_its_shard_shape_is_checked() -> None:
    from megatron.mpu.initialize_weights import initialize_param_

    def fails(t: torch.Tensor, gen: torch.Generator) -> None:
        raise AssertionError("drawn")

    with torch.device("meta"):
        shard = torch.empty(6, 4)
    initialize_param_(shard, "w", 0, fails, (12, 4), 0, rank=1, world=2)
    with pytest.raises(ValueError, match="shard shape"):
        initialize_param_(shard, "w", 0, fails, (12, 4), 0, rank=1, world=3)


# --- the two 1,024-rank layouts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(RUNS))
def test_the_rehearsal_runs_at_1024_ranks_within_two_minutes(rehearsals: dict[str, Done], name: str) -> None:
    done = rehearsals[name]
    assert done.code == 0, done.out[-3000:]
    assert done.seconds < TIME_LIMIT_S, done.seconds
    assert f"Layout: 1,024 ranks = tp {TP} x pp {PP} x dp {DP}; bf16, ZeRO-1" in done.out
    assert "BF16_Optimizer" in done.out
    assert done.out.rstrip().splitlines()[-1].startswith("deepy: rehearsal OK, nothing launched")


def test_the_layer_split_is_deepspeeds() -> None:
    assert layer_split(44) == SPLITS["20B"]
    assert layer_split(80) == SPLITS["70B"]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_stage_holds_the_layers_and_parameters_of_the_formula(rehearsals: dict[str, Done], name: str) -> None:
    rows = _section(rehearsals[name].out, "Pipeline stages")
    stages = [STAGES[name](n, i == 0, i == PP - 1) for i, n in enumerate(SPLITS[name])]
    first_block = 0
    for i, stage in enumerate(stages):
        cells = re.split(r"\s{2,}", rows[i].strip())
        assert cells[0] == str(i)
        assert cells[-4:] == [str(stage.blocks), f"{first_block}-{first_block + stage.blocks - 1}",
                              f"{stage.parameters:,}", f"{TP * stage.parameters:,}"], rows[i]
        first_block += stage.blocks
    assert "EmbeddingPipe + " in rows[0] and "+ FinalNormPipe + OutputLayerPipe" in rows[PP - 1]
    # the whole model: the published count, once the norms and biases every tp rank holds are counted once
    whole = next(line for line in rehearsals[name].out.splitlines() if line.startswith("Model: "))
    assert whole.startswith(f"Model: {PUBLISHED[name]:,} parameters")


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_holds_the_bytes_of_the_formula(rehearsals: dict[str, Done], name: str) -> None:
    rows = _section(rehearsals[name].out, "Per rank, in bytes")
    stages = [STAGES[name](n, i == 0, i == PP - 1) for i, n in enumerate(SPLITS[name])]
    seen: list[int] = []
    for row in rows:
        cells = re.split(r"\s{2,}", row.strip())
        ranks, stage_span, tp, dp, count, parameters = cells[:6]
        held = [_number(cell.split(" (")[0]) for cell in cells[6:10]]
        assert (tp, dp) == (f"0-{TP - 1}", f"0-{DP - 1}")  # the same on every tp and dp rank of a stage
        for s in _spans(stage_span):
            assert _number(parameters) == stages[s].parameters, (row, s)
            assert tuple(held) == expected_bytes(stages[s]), (row, s)
        # our topology's rank order: pipe, then data, then tensor (megatron/mpu/topology.py)
        assert _spans(ranks) == [r for s in _spans(stage_span) for r in range(s * TP * DP, (s + 1) * TP * DP)]
        assert int(count) == len(_spans(ranks))
        seen += _spans(ranks)
    assert sorted(seen) == list(range(WORLD))


@pytest.mark.parametrize("name", list(RUNS))
def test_the_traffic_of_the_middle_stages_follows_the_formulas(rehearsals: dict[str, Done], name: str) -> None:
    """A middle stage (no embedding, no head): every block all-reduces ``[s, b, h]`` 4 times and its recompute 2
    more (checkpoint_num_layers 1), each all-reduce sending 2(t-1)/t of it; the pipeline sends its 1/t part of
    the activation and of the gradient per micro-batch; BF16_Optimizer all-reduces its padded fp32 gradient
    buffer and all-gathers the padded bf16 weights once per step."""
    out = rehearsals[name].out
    step = STEP[name]
    stage = STAGES[name](SPLITS[name][1], False, False)
    block = next(i for i, line in enumerate(out.splitlines()) if re.match(r"  ranks \S+ \(stage 1", line))
    lines = out.splitlines()[block + 1:block + 8]
    sent = {}
    for line in lines:
        match = re.match(r"    (\w+)\s+(.+?)\s+=\s+([\d,]+) \(", line)
        if match:
            sent[(match[1], match[2].strip())] = _number(match[3])
    act = step["s"] * step["b"] * step["h"] * 2
    count = 6 * stage.blocks
    assert sent[("tp", f"m x {count} x 2(t-1)/t x s*b*h*a")] == round(step["m"] * count * 2 * (TP - 1) / TP * act)
    assert sent[("pp", "m x 2 x O/t")] == step["m"] * 2 * act // TP
    flat = padded(stage.decay) + padded(stage.no_decay)
    assert sent[("dp", "2(D-1)/D x c x padded T")] == round(2 * (DP - 1) / DP * 4 * flat)
    assert sent[("dp", "(D-1)/D x w x padded T")] == round((DP - 1) / DP * 2 * flat)


def test_a_world_size_the_layout_does_not_divide_is_refused_by_key() -> None:
    proc = _deepy("--rehearse", "1000", "train.py", *RUNS["20B"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    line = next(line for line in out.splitlines() if "config error" in line)
    assert "world size 1000" in line and "model_parallel_size=8" in line and "pipe_parallel_size=8" in line
    assert "rehearsal OK" not in out


def test_heads_that_the_tensor_parallel_size_does_not_divide_are_refused_by_key() -> None:
    proc = _deepy("--rehearse", "2048", "train.py", *RUNS["70B"], "model_parallel_size=16")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert re.search(r"num_kv_heads=8 .*model_parallel_size=16", out), out


# --- the ZeRO layout against DeepSpeed's own optimizers --------------------------------------------------------
DEEPSPEED_BUILDS = r"""
import json, os, torch, deepspeed
from megatron import mpu
from megatron.deepspeed_internals import skip_shared_memory_comm_op
from megatron.torch_internals import fake_process_group

skip_shared_memory_comm_op()
os.environ["LOCAL_RANK"] = "0"
found = {}
for stage, accum in ((1, "fp32"), (1, None), (2, None), (3, None), (0, None)):
    with fake_process_group(1, 4):
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False, rank=1, world_size=4)
        mpu.initialize_model_parallel(1, 0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7),
                                    torch.nn.Linear(7, 5, bias=False)).to(torch.bfloat16)
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 8}}
        if accum:
            config["data_types"] = {"grad_accum_dtype": accum}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups),
                                                       config=config, mpu=mpu, dist_init_required=False)
        sizes = lambda name: [t.numel() for t in getattr(optimizer, name)]
        row = {"class": type(optimizer).__name__}
        if stage == 3:
            row.update(owned=sizes("fp32_partitioned_groups_flat"),
                       persistent=sum(p.ds_numel for p in model.parameters() if p.ds_persist))
        elif stage > 0:
            flat = "bf16_groups_flat" if hasattr(optimizer, "bf16_groups_flat") else "bit16_groups_flat"
            part = "fp32_groups_flat_partition" if flat == "bf16_groups_flat" else "single_partition_of_fp32_groups"
            row.update(padded=sizes(flat), owned=sizes(part))
        found[f"{stage}/{accum}"] = row
        mpu.destroy_model_parallel()
print(json.dumps(found))
"""


def test_zero_layouts_are_the_ones_deepspeed_builds() -> None:
    from megatron.engine.zero_shards import Precision, elements

    done = subprocess.run([sys.executable, "-c", DEEPSPEED_BUILDS], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5, bias=False))
    params = list(model.parameters())
    groups = [[p for p in params if p.dim() > 1], [p for p in params if p.dim() < 2]]
    classes = {"bf16": "BF16_Optimizer", "zero": "DeepSpeedZeroOptimizer", "bf16_ddp": "FP16_UnfusedOptimizer"}
    for key, row in built.items():
        stage, accum = int(key.split("/")[0]), key.split("/")[1]
        how = Precision(precision="bf16", zero_stage=stage, pipeline=False, grad_accum_bytes=4 if accum == "fp32" else None,
                        offload=False, optimizer_states=2, persistence_threshold=8)
        assert row["class"].startswith(classes[how.wrapper]), (key, row, how.wrapper)
        laid = elements(groups, params, 4, how)
        if stage == 3:
            assert (laid.owned, laid.persistent) == (sum(row["owned"]), row["persistent"]), (key, row, laid)
        elif stage > 0:
            assert (laid.padded, laid.owned) == (sum(row["padded"]), sum(row["owned"])), (key, row, laid)


# --- the tensor-parallel collectives, counted while the layers run ------------------------------------------------
COLLECTIVES = r"""
import json, sys, warnings
import torch
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, "tests")
from gpt_configs import gpt_config
from megatron import mpu
from megatron.model.embedding import GPTEmbedding
from megatron.model.transformer_layer import TransformerLayer
from megatron.mpu.layers import parallel_lm_logits
from megatron.torch_internals import fake_process_group

warnings.filterwarnings("ignore", "Full backward hook is firing")  # meta tokens need no gradient


def counted(run):
    with CommDebugMode() as counts:
        run()
    return {str(op).split(".")[-1]: n for op, n in counts.get_comm_counts().items()}


found = {}
with fake_process_group(1, 4):
    mpu.initialize_model_parallel(2, 0)  # rank 1 of a tp-2 group
    for gpt_j in (False, True):
        for sp in (False, True):
            config = gpt_config(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                                max_position_embeddings=16, padded_vocab_size=128, gpt_j_residual=gpt_j,
                                sequence_parallel=sp)
            with torch.device("meta"):
                layer = TransformerLayer(config, 0)
                x = torch.randn(8 if sp else 16, 2, 64, requires_grad=True)
            out = []
            found[f"block {gpt_j} {sp}"] = [counted(lambda: out.append(layer(x))),
                                            counted(lambda: out[0].sum().backward())]
    for sp in (False, True):
        config = gpt_config(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                            max_position_embeddings=16, padded_vocab_size=128, sequence_parallel=sp)
        with torch.device("meta"):
            embedding = GPTEmbedding(config)
            tokens = torch.zeros(2, 16, dtype=torch.long)
            hidden = torch.randn(8 if sp else 16, 2, 64, requires_grad=True)
        out = []
        found[f"embedding {sp}"] = [counted(lambda: out.append(embedding(tokens))),
                                    counted(lambda: out[0].sum().backward())]
        weight = embedding.word_embeddings.weight
        logits = []
        found[f"logits {sp}"] = [counted(lambda: logits.append(parallel_lm_logits(hidden, weight, sp))),
                                 counted(lambda: logits[0].sum().backward())]
    mpu.destroy_model_parallel()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def collectives() -> dict[str, list[dict[str, int]]]:
    """(forward, backward) collectives of each layer at tp 2, run on the meta device on the fake backend, counted by
    torch's CommDebugMode; in a process of its own (a pytest worker may hold the single-rank gloo world other tests
    share: tests/single_rank.py)."""
    done = subprocess.run([sys.executable, "-c", COLLECTIVES], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("gpt_j_residual", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_block_all_reduces_twice_forward_and_twice_backward(collectives: dict[str, list[dict[str, int]]],
                                                              gpt_j_residual: bool, sequence_parallel: bool) -> None:
    forward, backward = collectives[f"block {gpt_j_residual} {sequence_parallel}"]
    # an all-reduce, or under sequence parallelism an all-gather plus a reduce-scatter (the same bytes)
    expected = {"_allgather_base_": 2, "_reduce_scatter_base_": 2} if sequence_parallel else {"allreduce_": 2}
    assert forward == expected and backward == expected


def test_the_embedding_all_reduces_forward_and_the_logits_backward(collectives: dict[str, list[dict[str, int]]]) -> None:
    assert collectives["embedding False"] == [{"allreduce_": 1}, {}]
    assert collectives["logits False"] == [{}, {"allreduce_": 1}]
    # sequence parallelism: the embedding's output is split after its all-reduce, so its gradient is gathered back;
    # the logits gather the sequence and reduce-scatter its gradient (an all-reduce's bytes)
    assert collectives["embedding True"] == [{"allreduce_": 1}, {"_allgather_base_": 1}]
    assert collectives["logits True"] == [{"_allgather_base_": 1}, {"_reduce_scatter_base_": 1}]


def test_the_tp_rows_follow_the_counted_collectives_under_sequence_parallelism() -> None:
    """The first stage of a tp-2 pipeline with sequence parallelism, 3 blocks, none recomputed: the counts above
    (4 all-reduces' bytes per block, the embedding's all-reduce and its gradient's all-gather), and the received
    gradient regathered from the tp ranks' halves of the sequence shard the stage hands on."""
    from megatron.engine.comm_volume import StepShape, tensor_parallel

    shape = StepShape(tp=2, stages=2, dp=1, micro_batch=2, seq_length=16, hidden=64, micro_batches=3,
                      activation_bytes=2, sequence_parallel=True, partition_activations=False, comm_bytes=4)
    act = 16 * 2 * 64 * 2
    rows = {row.formula: row.sent for row in tensor_parallel(shape, blocks=3, recomputed=0, chunks=0, embedding=True,
                                                              lm_head=False, first=True, last=False)}
    assert rows == {"m x 13 x 2(t-1)/t x s*b*h*a": 3 * 13 * act, "m x (t-1)/t x s*b*h*a": 3 * act // 2,
                    "m x 1 x (t-1)/t x O": 3 * (act // 2) // 2}
