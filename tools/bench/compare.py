#!/usr/bin/env python
"""Side by side in one process: the same architecture, batch and optimizer trained by

* ``deepy``: Deepy's trainer step, as ``train.py`` runs it: the config goes through the real loader
  and rules (``load_config`` + ``finalize``), ``initialize``, the DeepSpeed engine of
  ``build_engine`` and ``train_step`` over the trainer's own prefetching micro-batch iterator
  (dummy data, generated every step; the others reuse one batch already on the device);
* ``hf``: Hugging Face ``transformers`` ``GPTNeoXForCausalLM`` (SDPA attention) + torch AdamW
  (fused where the device has it) in a plain loop;
* ``nanogpt``: a one-file GPT in raw PyTorch (``tools/bench/nanogpt.py``) + the same AdamW;
* ``raw`` (optional): Deepy's own model in that plain loop, which isolates the trainer's overhead.

    python tools/bench/compare.py                         # 4 x 256 GPT, seq 256, batch 8, fp32 on CPU
    python tools/bench/compare.py --contenders deepy,raw  # the trainer's overhead over its own model
    python tools/bench/compare.py --layers 12 --hidden 768 --heads 12 --seq 2048 --batch 8 \\
        --vocab 50304 --zero 1                            # a GPU (bf16 by default there)

Every contender: AdamW(lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices), gradient clipping at
1.0, bf16 on a GPU (DeepSpeed's bf16 engine for deepy, autocast for the others). Prints tokens/s,
TFLOP/s, the share of the machine's matmul peak measured in the same run, MFU (GPU), peak memory
(GPU) and the ratios of deepy to the others (the median of per-round ratios, see harness.py).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import torch
import torch.nn.functional as F

from tools.bench import harness
from tools.bench.harness import Arch, Contender

LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0
CONTENDERS = ("deepy", "hf", "nanogpt", "raw")
GOALS = {("deepy", "hf"): 1.0, ("deepy", "nanogpt"): 0.95, ("deepy", "raw"): 0.95}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    harness.add_arch_arguments(p)
    p.add_argument("--contenders", default="deepy,hf,nanogpt",
                   help=f"comma-separated, from {','.join(CONTENDERS)}; ratios are deepy / each other")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=None,
                   help="deepy's ZeRO stage (default: 1 on a GPU, 0 on a CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile: deepy's compile_layers, torch.compile(model) for the others")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender")
    p.add_argument("--block", type=int, default=3, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5, help="timed blocks per contender")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: time by the process's CPU seconds (with --threads 1, steady on a loaded machine)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n x n matmul peak (default 1024 CPU, 8192 GPU)")
    return p.parse_args(argv)


def fixed_batch(arch: Arch, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One random batch (inputs, next-token targets) `[b, s]` for the plain loops."""
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, arch.vocab, (arch.batch, arch.seq + 1), generator=gen)
    return text[:, :-1].contiguous().to(dev), text[:, 1:].contiguous().to(dev)


def autocast(arch: Arch, dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=arch.precision == "bf16")


def plain_loop(model: torch.nn.Module, loss_of: Any, optimizer: torch.optim.Optimizer, arch: Arch,
               dev: torch.device) -> Any:
    """The step a hand-written loop runs: forward + loss under autocast, backward, clip, step."""
    params = [p for p in model.parameters() if p.requires_grad]
    cast = autocast(arch, dev)

    def step() -> None:
        with cast:
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)  # stays on the device: no host sync
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# --- the contenders ---------------------------------------------------------------------------------
def deepy_config(arch: Arch, zero: int, compile_layers: bool) -> dict[str, Any]:
    """The config a user would write for this architecture (GPT-NeoX key names)."""
    return {
        "num_gpus": 1, "pipe_parallel_size": 0, "model_parallel_size": 1,
        "num_layers": arch.layers, "hidden_size": arch.hidden, "num_attention_heads": arch.heads,
        "seq_length": arch.seq, "max_position_embeddings": arch.seq, "norm": "layernorm", "pos_emb": "rotary",
        "no_weight_tying": True, "padded_vocab_size": arch.vocab,
        "tokenizer_type": "CharLevelTokenizer", "use_dummy_dataset": True,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1.0e-8}},
        "weight_decay": WEIGHT_DECAY, "gradient_clipping": CLIP, "lr_decay_style": "cosine", "warmup": 0.01,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "precision": "bfloat16" if arch.precision == "bf16" else "fp32",
        "zero_optimization": {"stage": zero},
        "train_batch_size": arch.batch, "train_micro_batch_size_per_gpu": arch.batch,
        "train_iters": 1_000_000, "compile_layers": compile_layers, "steps_per_print": 10**9,
    }


def run_config(config: dict[str, Any]) -> Any:
    """The typed RunConfig, through the same loader and rules as deepy.py."""
    from megatron.neox_arguments.run_config import RunConfig

    return RunConfig.from_mapping(config)


def deepy_contender(arch: Arch, zero: int, compile_layers: bool) -> tuple[Contender, Any]:
    from megatron.data.build import build_datasets
    from megatron.data.sampler import MicroBatchIterator, prefetched
    from megatron.initialize import initialize
    from megatron.tokenizer import build_tokenizer
    from megatron.engine.build import build_engine
    from megatron.training.step import train_step

    run = run_config(deepy_config(arch, zero, compile_layers))
    initialize(run.parallel, run.training.seed)
    tokenizer = build_tokenizer(run.tokenizer)
    model_config = run.model.for_tokenizer(run.tokenizer.padded(tokenizer.vocab_size, run.parallel.model_parallel_size))
    eng = build_engine(run, model_config, run.training.loop.train_iters or 1)
    dev = harness.device()
    # the trainer's loader, as pretrain() builds it
    source = MicroBatchIterator(build_datasets(run.data, tokenizer, model_config.padded_vocab_size).train, 0,
                                run.training.batch.on(dp=1))
    micro = prefetched(source, run.training.loop.num_workers)

    def step() -> None:
        train_step(eng, micro, dev)

    label = f"deepy train_step, DeepSpeed engine ZeRO-{zero}" + (", compile_layers" if compile_layers else "")
    return Contender("deepy", label, step), (run, model_config)


def raw_contender(arch: Arch, built: Any, compile_model: bool) -> Contender:
    """Deepy's model, optimizer and LR schedule in a plain loop (no DeepSpeed engine)."""
    from megatron.model import GPTModel, lm_loss
    from megatron.engine.lr_schedules import LRScheduler
    from megatron.engine.optimizers import build_optimizer

    run, model_config = built
    dev = harness.device()
    model = GPTModel(model_config.replace(precision="fp32")).to(dev)
    optimizer = build_optimizer(model, run.optimizer_config)
    train_iters = run.training.loop.train_iters or 1
    scheduler = LRScheduler(optimizer, run.lr_config.spec(train_iters, run.optimizer_config.peak_lr))
    tokens, labels = fixed_batch(arch, dev)
    forward = torch.compile(model) if compile_model else model
    inner = plain_loop(model, lambda: lm_loss(forward(tokens), labels), optimizer, arch, dev)

    def step() -> None:
        inner()
        scheduler.step()

    return Contender("raw", "Deepy's GPTModel + its AdamW and LR schedule in a plain loop", step)


def hf_contender(arch: Arch, compile_model: bool) -> Contender:
    from tools.bench.nanogpt import adamw
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    dev = harness.device()
    config = GPTNeoXConfig(
        vocab_size=arch.vocab, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, intermediate_size=4 * arch.hidden,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        max_position_embeddings=arch.seq, use_parallel_residual=False, hidden_dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(config)
    model.set_attn_implementation("sdpa")
    # transformers types PreTrainedModel.to as an unbound wrapper (its first argument the model): arg-type
    model = model.to(dev)  # type: ignore[arg-type]
    forward = torch.compile(model) if compile_model else model
    tokens, labels = fixed_batch(arch, dev)

    def loss() -> torch.Tensor:
        logits = forward(input_ids=tokens).logits  # [b, s, v]
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    step = plain_loop(model, loss, adamw(model, LR, WEIGHT_DECAY, BETAS), arch, dev)
    return Contender("hf", "transformers GPTNeoXForCausalLM (sdpa) + torch AdamW, plain loop", step)


def nanogpt_contender(arch: Arch, compile_model: bool) -> Contender:
    from tools.bench.nanogpt import GPT, adamw

    dev = harness.device()
    model = GPT(layers=arch.layers, hidden=arch.hidden, heads=arch.heads, seq=arch.seq, vocab=arch.vocab).to(dev)
    forward = torch.compile(model) if compile_model else model
    tokens, labels = fixed_batch(arch, dev)
    step = plain_loop(model, lambda: forward(tokens, labels), adamw(model, LR, WEIGHT_DECAY, BETAS), arch, dev)
    return Contender("nanogpt", "one-file raw PyTorch GPT (tools/bench/nanogpt.py) + torch AdamW", step)


def build_contenders(names: list[str], arch: Arch, zero: int, compile_model: bool) -> list[Contender]:
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or not names:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {','.join(CONTENDERS)}")
    harness.single_process_env()
    # deepy first: its initialize() builds the process group and seeds the RNGs the others then use
    deepy, args = deepy_contender(arch, zero, compile_model)
    built = {"deepy": deepy}
    for name in names:
        if name == "hf":
            built[name] = hf_contender(arch, compile_model)
        elif name == "nanogpt":
            built[name] = nanogpt_contender(arch, compile_model)
        elif name == "raw":
            built[name] = raw_contender(arch, args, compile_model)
    return [built[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    if o.threads:
        torch.set_num_threads(o.threads)
    arch = harness.arch_from(o)
    zero = o.zero if o.zero is not None else (1 if torch.cuda.is_available() else 0)
    names = [n.strip() for n in o.contenders.split(",") if n.strip()]

    def say(line: str) -> None:  # every phase says it started: a run takes minutes
        print(line, flush=True)

    say(f"building {', '.join(names)} ({arch.layers} layers x {arch.hidden}, seq {arch.seq}, batch {arch.batch})...")
    started = time.perf_counter()
    contenders = build_contenders(names, arch, zero, o.compile)
    say(f"built in {time.perf_counter() - started:.1f} s; measuring the matmul peak...")
    peak_before = harness.matmul_tflops(arch.precision, o.matmul_size, clock=o.clock)
    say(f"{o.warmup} warm-up steps per contender, then {o.rounds} rounds of {o.block} timed steps each...")
    harness.run_rounds(contenders, warmup=o.warmup, block=o.block, rounds=o.rounds, clock=o.clock, progress=say)
    # the peak is measured before and after the rounds; the better one is the machine's ceiling
    say("measuring the matmul peak again...")
    peak = max(peak_before, harness.matmul_tflops(arch.precision, o.matmul_size, clock=o.clock))
    print(harness.report(arch, contenders, block=o.block, matmul_peak=peak, clock=o.clock, goals=GOALS), flush=True)
    return 0


if __name__ == "__main__":
    from megatron.errors import run_guarded
    from megatron.initialize import exit_process

    try:
        run_guarded(main)
    except SystemExit as done:
        exit_process(done.code)
