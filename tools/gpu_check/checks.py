"""The measurements of ``deepy-gpu-check``, one function per check of ``plan.py``.

Each runs in a process of its own (``python -m tools.gpu_check.checks NAME --out FILE``), started and
killed at its cap by ``cli.py``, and writes one JSON object. ``smoke`` shrinks the shapes so the parts
that make sense on a CPU run there in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
Result = dict[str, Any]


def _gpu() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _gpu():
        torch.cuda.synchronize()


# --- environment ---------------------------------------------------------------------------------------
def environment(smoke: bool, work: Path) -> Result:
    import deepspeed

    from megatron.launcher.environment import visible_devices
    from megatron.logging.throughput import peak_tflops
    from megatron.engine.compile_checks import toolchain_problems

    out: Result = {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                   "cuda_visible_devices": visible_devices(os.environ) or None,
                   "compile_toolchain_problems": toolchain_problems(_gpu())}
    with contextlib.suppress(metadata.PackageNotFoundError):  # torch's CUDA wheels bring it; not ours to declare
        out["triton"] = metadata.version("triton")
    if not _gpu():
        out["device"] = f"CPU ({os.cpu_count()} cores)"
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
               memory_gib=round(props.total_memory / 2**30, 1), compute_capability=f"{props.major}.{props.minor}",
               cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               nccl=".".join(map(str, torch.cuda.nccl.version())), bf16=torch.cuda.is_bf16_supported(),
               peak_bf16_tflops=peak_tflops(torch.cuda.get_device_name(0), "bf16"))
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            out["nvidia_smi"] = query.stdout.strip().splitlines()[:1]
    return out


# --- attention ---------------------------------------------------------------------------------------
KERNEL_OPS = {"flash": "_flash_attention", "efficient": "_efficient_attention", "cudnn": "_cudnn_attention",
              "math": "_scaled_dot_product_attention_math"}


def attention_variants(heads: int, kv: int, seq: int) -> dict[str, dict[str, Any]]:
    """Deepy's attention variants as GPT-NeoX keys (on top of one shape)."""
    return {
        "causal": {},
        "gqa": {"num_kv_heads": kv},
        "window >= seq (Mistral at 4096)": {"sliding_window_width": seq},
        "window < seq": {"sliding_window_width": seq // 4},
        "gqa + window < seq": {"num_kv_heads": kv, "sliding_window_width": seq // 4},
        "alibi": {"pos_emb": "alibi"},
        "rpe": {"pos_emb": "rpe"},
        "inverse layer scale": {"scale_attn_by_inverse_layer_idx": True},
        "packed documents": {"documents": 4},
    }


def _kernel_of(run: Callable[[], Any]) -> str:
    """Which SDPA implementation ran, read from the op names the profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = {event.name for event in prof.events()}
    found = [kernel for kernel, op in KERNEL_OPS.items() if any(op in name for name in names)]
    return "+".join(found) or "none"


def attention(smoke: bool, work: Path) -> Result:
    from megatron.model import GPTConfig
    from megatron.model.attention import SelfAttention
    from megatron.engine.memory import sdpa_kernel

    gpu = _gpu()
    dev = torch.device("cuda" if gpu else "cpu")
    dtype, precision = (torch.bfloat16, "bf16") if gpu else (torch.float32, "fp32")
    b, s, hidden, heads, kv = (2, 4096, 4096, 32, 8) if gpu and not smoke else (1, 64, 64, 4, 2)
    out: Result = {"shape": f"b={b} s={s} hidden={hidden} heads={heads} dtype={precision}"}
    variants = attention_variants(heads, kv, s)
    if smoke:  # one of each kind of call: causal, a bool mask with repeated kv heads, a float bias, documents
        variants = {k: variants[k] for k in ("causal", "gqa + window < seq", "alibi", "packed documents")}
    for name, keys in variants.items():
        documents = keys.pop("documents", 0)
        config = GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=heads, seq_length=s,
                           max_position_embeddings=s, padded_vocab_size=128, pos_emb=keys.pop("pos_emb", "rotary"),
                           **keys)
        layer = SelfAttention(config, "attention", layer_number=1).to(device=dev, dtype=dtype)
        x = torch.randn(s, b, hidden, device=dev, dtype=dtype, requires_grad=True)
        ids = (torch.arange(s, device=dev) * documents // s).expand(b, s).contiguous() if documents else None

        def step() -> None:
            layer(x, document_ids=ids).float().square().mean().backward()

        step()  # warm-up: kernels chosen and loaded
        _sync()
        kernel = _kernel_of(step)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        step()
        _sync()
        row: Result = {"kernel": kernel, "ms": round(1e3 * (time.perf_counter() - start), 2)}
        if gpu:  # the estimate's rule is CUDA's dispatch (a CPU has kernels of its own)
            row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            if not documents:
                row["predicted"] = sdpa_kernel(config, precision, s)
        out[name] = row
        del layer, x
    return out


# --- compile_layers ----------------------------------------------------------------------------------
def _device_and_dtype() -> tuple[torch.device, torch.dtype]:
    return (torch.device("cuda"), torch.bfloat16) if _gpu() else (torch.device("cpu"), torch.float32)


def _compiled_model(keys: dict[str, Any], layers: int, hidden: int, heads: int, seq: int) -> Any:
    from megatron.model import GPTConfig, GPTModel
    from megatron.engine.build import transformer_layers

    config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                       max_position_embeddings=seq, padded_vocab_size=50304, pos_emb="rotary", **keys)
    dev, dtype = _device_and_dtype()
    model = GPTModel(config).to(device=dev, dtype=dtype)
    for layer in transformer_layers(model):  # what compile_layers does (engine/build.py wrap_layers)
        layer.forward = torch.compile(layer.forward)
    return model


def compile_check(smoke: bool, work: Path) -> Result:
    from megatron.model import lm_loss
    from megatron.torch_internals import compile_counts, reset_compile_counts

    layers, hidden, heads, seq, batch = (2, 64, 4, 64, 2) if smoke else (8, 1024, 16, 2048, 4)
    dev, dtype = _device_and_dtype()
    out: Result = {"shape": f"{layers} layers x {hidden}, seq {seq}, batch {batch}, {dtype}"}
    for name, keys in (("plain", {}), ("inverse layer scale", {"scale_attn_by_inverse_layer_idx": True})):
        reset_compile_counts()
        model = _compiled_model(keys, layers, hidden, heads, seq)
        tokens = torch.randint(0, 50304, (batch, seq + 1), device=dev)

        def step() -> None:
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

        start = time.perf_counter()
        step()
        _sync()
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(3):
            step()
        _sync()
        graphs, breaks = compile_counts()
        out[name] = {"first_step_s": round(first, 1), "step_ms": round((time.perf_counter() - start) / 3 * 1e3, 1),
                     "graphs": graphs, "graph_breaks": breaks}
        del model
    return out


# --- the trainer's step -------------------------------------------------------------------------------
def _deepy_step(layers: int, hidden: int, heads: int, seq: int, batch: int, zero: int = 1) -> tuple[Any, Any, Any]:
    from tools.bench import compare, harness

    harness.single_process_env()
    arch = harness.Arch(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=50304,
                        precision="bf16" if _gpu() else "fp32")
    contender, built = compare.deepy_contender(arch, zero, False)
    return arch, contender, built


@contextlib.contextmanager
def _sync_sites(sites: Counter[str]) -> Iterator[None]:
    """Count each synchronising CUDA call by the innermost file:line of Deepy, DeepSpeed or torch's
    Python that made it."""
    previous = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/megatron/" in f.filename or "/deepspeed/" in f.filename or "/tools/" in f.filename]
        where = frames[-1] if frames else None
        sites[f"{where.filename.split('site-packages/')[-1].replace(str(REPO) + '/', '')}:{where.lineno}"
              if where else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = previous


def sync_audit(smoke: bool, work: Path) -> Result:
    _, contender, _ = _deepy_step(*((2, 64, 4, 64, 2) if smoke else (4, 512, 8, 512, 4)))
    for _ in range(3):
        contender.step()
    _sync()
    sites: Counter[str] = Counter()
    if not _gpu():  # no device to wait for: the steps only run
        contender.step()
        return {"syncs_in_2_steps": None, "by_site": {}}
    with _sync_sites(sites):
        for _ in range(2):
            contender.step()
        _sync()
    return {"syncs_in_2_steps": sum(sites.values()), "by_site": dict(sites.most_common(20))}


def memory_350m(smoke: bool, work: Path) -> Result:
    from megatron.engine.memory import GiB, MemoryLayout, estimate

    arch, contender, (run, model_config) = _deepy_step(*((2, 64, 4, 64, 2) if smoke else (24, 1024, 16, 2048, 4)))
    est = estimate(MemoryLayout.from_run(run, 1, model_config.padded_vocab_size))
    out: Result = {"shape": arch.describe(), "estimate_gib": round(est.total / GiB, 3),
                   "model_states_gib": round(est.model_states / GiB, 3), "activations_gib": round(est.activations / GiB, 3)}
    if _gpu():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        contender.step()
    _sync()
    if _gpu():
        measured = torch.cuda.max_memory_allocated() / GiB
        out.update(measured_max_allocated_gib=round(measured, 2), estimate_over_measured=round(est.total / GiB / measured, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2))
    return out


def trainer_125m(smoke: bool, work: Path) -> Result:
    from tools.bench import compare, harness

    arch, deepy, built = _deepy_step(*((2, 64, 4, 64, 2) if smoke else (12, 768, 12, 2048, 8)))
    raw = compare.raw_contender(arch, built, False)
    harness.run_rounds([deepy, raw], warmup=3, block=4, rounds=3)
    tokens = arch.tokens_per_step * 4
    rate = {c.name: tokens / sorted(c.block_seconds)[1] for c in (deepy, raw)}
    peak = harness.dense_peak(arch.precision)
    flops = arch.flops_per_token()
    return {"shape": arch.describe(), "tokens_per_s": {k: round(v) for k, v in rate.items()},
            "mfu": {k: round(v * flops / 1e12 / peak, 4) for k, v in rate.items()} if peak else None,
            "deepy_over_raw": round(rate["deepy"] / rate["raw"], 3),
            "peak_memory_gib": {c.name: c.peak_memory_gb for c in (deepy, raw)}}


# --- deepy.py end to end ---------------------------------------------------------------------------------
TINY = ["configs/tiny.yml", "num_gpus=1", "use_dummy_dataset=true", "tokenizer_type=CharLevelTokenizer",
        "hidden_dropout=0.1", "attention_dropout=0.1", "train_iters=8", "lr_decay_iters=8", "log_interval=1",
        "checkpoint_factor=4", "eval_iters=0", "eval_interval=1000"]


def _losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for path in log_dir.rglob("metrics.jsonl") for line in path.read_text().splitlines()]
    return {r["iteration"]: r["train/lm_loss"] for r in rows if "train/lm_loss" in r}


def _deepy(args: list[str], timeout: float) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "deepy.py", "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, (done.stdout + done.stderr)[-1500:]


def tiny_resume(smoke: bool, work: Path) -> Result:
    from megatron.checkpointing.commit import tag_for

    args = [*TINY, f"precision={'bfloat16' if _gpu() else 'fp32'}"]
    straight, resumed = work / "straight", work / "resumed"
    rc, tail = _deepy([*args, f"save={straight}", f"log_dir={straight}/logs"], 70)
    if rc:
        return {"error": f"straight run exited {rc}", "tail": tail}
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("logs"))
    shutil.rmtree(resumed / tag_for(8))
    rc, tail = _deepy([*args, f"save={resumed}", f"load={resumed}", f"log_dir={resumed}/logs"], 70)
    if rc:
        return {"error": f"resumed run exited {rc}", "tail": tail}
    a, b = _losses(straight / "logs"), _losses(resumed / "logs")
    steps = sorted(b)
    return {"resumed_steps": steps, "bit_equal": bool(steps) and all(a.get(i) == b[i] for i in steps),
            "straight": [a.get(i) for i in steps], "resumed": [b[i] for i in steps]}


def gpu_libraries(smoke: bool, work: Path) -> Result:
    """pytest on the GPU-only library tests: passed, skipped (with why) and failed, by test."""
    report = work / "junit.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-rs",
                           f"--junitxml={report}", "tests/unit/test_gpu_libraries_device.py"],
                          cwd=REPO, capture_output=True, text=True)
    out: Result = {"exit_code": done.returncode, "tail": done.stdout[-1500:]}
    if done.returncode not in (0, 5):
        out["error"] = f"pytest exited {done.returncode}: " + done.stdout.strip().splitlines()[-1][:200]
    return out


CHECKS: dict[str, Callable[[bool, Path], Result]] = {
    "environment": environment, "attention": attention, "compile": compile_check, "sync_audit": sync_audit,
    "memory_350m": memory_350m, "trainer_125m": trainer_125m, "tiny_resume": tiny_resume,
    "gpu_libraries": gpu_libraries,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one check of deepy-gpu-check (run by tools/gpu_check/cli.py)")
    p.add_argument("name", choices=sorted(CHECKS))
    p.add_argument("--out", type=Path, required=True, help="the JSON file this check writes")
    p.add_argument("--smoke", action="store_true")
    o = p.parse_args(argv)
    work = o.out.parent / f"{o.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = CHECKS[o.name](o.smoke, work)
        status = "error" if "error" in result else "ok"
    except Exception as err:  # the report says what broke; the next check still runs
        result, status = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}, "error"
    o.out.write_text(json.dumps({"status": status, **result}, default=str, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from megatron.initialize import exit_process

    exit_process(main())
