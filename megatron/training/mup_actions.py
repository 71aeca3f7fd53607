"""What ``save_base_shapes`` and ``coord_check`` do instead of training (GPT-NeoX ea7aefd8 megatron/training.py
``save_base_shapes`` and ``mup_coord_check``, with mup 1.0.0): write the muP base shapes file, or run muP's
coordinate check and plot it, then stop. The muP model itself is ``megatron/model/mup.py``; mup's arithmetic is
ported in ``megatron/model/mup_shapes.py`` and its coordinate check here (mup 1.0.0 requires torchvision, which breaks
transformers on a CPU torch).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.model import GPTConfig, GPTModel
from megatron.model.mup import apply_base_shapes, model_shapes
from megatron.model.mup_shapes import make_base_shapes, mu_adam_groups, mu_sgd_groups, save_base_shapes
from megatron.objectives import build_objective
from megatron.training.train_config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]
"""(tokens ``[b, s]``, targets ``[b * s]`` with -100 where nothing counts), as mup's get_coord_data reads them."""


class Coord(NamedTuple):
    """One record of the coordinate check (a row of mup's ``get_coord_data`` frame): the mean absolute value (l1)
    of ``module``'s output (``name:out[i]`` for the i-th tensor of a tuple) in the forward of step ``t`` (from 1,
    before that step's update) of the model ``width`` wide."""

    width: int
    module: str
    t: int
    l1: float


def write_base_shapes(config: GPTConfig, path: str) -> None:
    """GPT-NeoX's ``save_base_shapes``: mup's ``make_base_shapes`` of this model and of one ``mup_width_scale``
    times as wide (its hidden size only), written to ``path`` in mup's format. Both are built on the meta device:
    only their shapes are read."""
    assert config.hidden_size is not None
    with torch.device("meta"):
        base = model_shapes(GPTModel(config.replace(use_mup=False)))
        delta = model_shapes(GPTModel(config.replace(use_mup=False,
                                                     hidden_size=config.hidden_size * config.mup_width_scale)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_base_shapes(make_base_shapes(base, delta), path)


def coord_check_widths(config: GPTConfig) -> list[int]:
    """GPT-NeoX's widths: ``num_attention_heads x 2**p`` for p in 2..8 (so every width splits into the heads)."""
    return [config.arch.heads * 2**p for p in range(2, 9)]


def coord_check(config: GPTConfig, batches: Sequence[Batch], optimizer: str, lr: float, out_dir: str | None,
                widths: Sequence[int] | None = None, device: torch.device | None = None) -> dict[str, list[Coord]]:
    """The coordinate check of models of each width, muP (``up``) and standard parametrisation (``sp``):
    ``len(batches)`` steps of muP's Adam/SGD (torch's for sp) at ``lr``, the mean absolute value (``l1``) of every
    module's output before each step (:func:`coord_data`). Writes ``coord_check_up.png`` and ``coord_check_sp.png``
    (:func:`plot_coord_check`) to ``out_dir`` unless it is None; returns the records by tag."""
    device = device or torch.device("cpu")

    def lazy(width: int, use_mup: bool) -> Callable[[], GPTModel]:
        def build() -> GPTModel:
            wide = config.replace(hidden_size=width, use_mup=use_mup)
            with torch.device(device):
                model = GPTModel(wide)
            if use_mup:
                apply_base_shapes(model, wide)
            return model

        return build

    records = {}
    for tag, use_mup in (("up", True), ("sp", False)):
        models = {width: lazy(width, use_mup) for width in widths or coord_check_widths(config)}
        records[tag] = coord_data(models, batches, optimizer, lr, use_mup, device)
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            plot_coord_check(records[tag], os.path.join(out_dir, f"coord_check_{tag}.png"),
                             f"{'muP' if use_mup else 'standard parametrisation'}: {optimizer}, lr={lr}")
    return records


def coord_data(models: Mapping[int, Callable[[], nn.Module]], batches: Sequence[Batch], optimizer: str, lr: float,
               use_mup: bool, device: torch.device) -> list[Coord]:
    """mup 1.0.0's ``get_coord_data`` (one seed, ``fix_data=False``, ``flatten_output=True``, its default ``l1``
    statistic): seed 0, then for each width a fresh model trained on ``batches`` in turn with cross-entropy and
    ``optimizer`` (``sgd`` or ``adam``: mup's MuSGD/MuAdam with ``use_mup``, else torch's) at ``lr``; at each step
    every module's output is recorded by a forward hook in that step's forward."""
    records: list[Coord] = []
    torch.manual_seed(0)
    for width, build in models.items():
        model = build().train()
        opt = _coord_optimizer(model, optimizer, lr, use_mup)
        for t, (tokens, targets) in enumerate(batches, 1):
            hooks = [module.register_forward_hook(_recorder(records, width, name, t))
                     for name, module in model.named_modules()]
            logits = model(tokens.to(device))  # [b, s, v]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            for hook in hooks:
                hook.remove()
    return records


def _coord_optimizer(model: nn.Module, kind: str, lr: float, use_mup: bool) -> torch.optim.Optimizer:
    """mup's ``get_coord_data`` optimizer: one group of every parameter, split by MuSGD/MuAdam's rules under muP."""
    groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    if use_mup:
        groups = [g for g in (mu_sgd_groups if kind == "sgd" else mu_adam_groups)(groups, lr=lr) if g["params"]]
    return torch.optim.SGD(groups, lr=lr) if kind == "sgd" else torch.optim.Adam(groups, lr=lr)


def _recorder(records: list[Coord], width: int, name: str, t: int) -> Callable[[nn.Module, Any, Any], None]:
    """mup's ``_record_coords`` hook: the l1 (``x.abs().mean()``) of each tensor the module outputs, a tuple's i-th
    as ``name:out[i]`` (nested: ``[i][j]``); outputs that are not floating tensors are skipped."""

    def add(label: str, x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            records.append(Coord(width, label, t, float(x.detach().abs().mean())))
        elif isinstance(x, (tuple, list)):
            for i, item in enumerate(x):
                add(f"{label}[{i}]", item)
        elif isinstance(x, dict):
            for key, item in x.items():
                add(f"{label}[{key}]", item)

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, (tuple, list, dict)):
            add(f"{name}:out", output)
        else:
            add(name, output)

    return hook


def plotted_module(name: str) -> bool:
    """The modules a plot shows: the logits (the whole model, ``""``), the embedding, each block's attention and
    MLP, and the final norm (mup's ``plot_coord_data`` shows every module, with a legend that hides the axes)."""
    parts = name.split(".")
    return name in ("", "embedding", "final_norm", "output_layer") or (
        len(parts) == 3 and parts[0] == "layers" and parts[2] in ("attention", "mlp"))


def plot_coord_check(records: Sequence[Coord], path: str, title: str) -> None:
    """mup's coordinate check plot: the mean absolute output (l1) of each module against the width, log-log, one
    panel per step, the legend beside them."""
    # lazy: matplotlib only for a coordinate check's plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as matplotlib above

    shown = [r for r in records if plotted_module(r.module)]
    steps = sorted({r.t for r in shown})
    fig, axes = plt.subplots(1, len(steps), figsize=(4.5 * len(steps) + 3, 4.5), squeeze=False)
    for ax, step in zip(axes[0], steps):
        l1s: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in shown:
            if r.t == step:
                l1s[r.module][r.width].append(r.l1)
        for module in sorted(l1s):
            points = sorted(l1s[module].items())
            ax.plot([w for w, _ in points], [float(np.mean(v)) for _, v in points], marker="o",
                    label=module or "logits")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("width (hidden_size)")
        ax.set_title(f"after {step - 1} update{'s' if step > 2 else ''}" if step > 1 else "at init")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("mean |activation| (l1)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize="small")
    fig.suptitle(f"coordinate check, {title} (flat lines: widths agree)")
    fig.tight_layout(rect=(0, 0, 1 - 2.8 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def coord_check_batches(train_split: Any, micro_batch: int, steps: int, prepare: Callable[[Any], Any]) -> list[Batch]:
    """The first ``steps`` micro-batches of the train split as (tokens, flat targets): GPT-NeoX's coordinate check
    takes consecutive batches of its train iterator."""
    batches = []
    for step in range(steps):
        samples = [train_split[step * micro_batch + i] for i in range(micro_batch)]
        sample = {key: torch.as_tensor(np.stack([s[key] for s in samples])) for key in samples[0]}
        batch = prepare(sample)
        batches.append((batch.inputs, batch.labels.reshape(-1)))
    return batches


def wanted(config: GPTConfig) -> bool:
    """The run writes base shapes or checks coordinates instead of training (GPT-NeoX reads both under use_mup)."""
    return config.use_mup and (config.save_base_shapes or config.coord_check)


def mup_action(run: TrainConfig, config: GPTConfig, train_split: Any, micro_batch: int, eod_token: int | None,
               device: torch.device) -> str:
    """``save_base_shapes`` or ``coord_check`` for the run (the optimizer's kind and peak lr, three micro-batches
    of the train split, plots beside ``base_shapes_file``): what was written."""
    assert config.base_shapes_file is not None  # the checks before launch require it with use_mup
    objective = build_objective(run.objective, eod_token=eod_token)
    opt = run.optimizer_config
    return run_mup_action(config, os.path.dirname(os.path.abspath(config.base_shapes_file)),
                          lambda: coord_check_batches(train_split, micro_batch, 3, objective.prepare),
                          "sgd" if opt.optimizer_kind == "sgd" else "adam", opt.peak_lr, device)


def run_mup_action(config: GPTConfig, out_dir: str, make_batches: Callable[[], list[Batch]], optimizer: str,
                   lr: float, device: torch.device) -> str:
    """``save_base_shapes`` (rank 0 writes the file) or ``coord_check`` (rank 0 runs it): what was written."""
    assert config.base_shapes_file is not None  # the checks before launch require it with use_mup
    rank = dist.get_rank() if dist.is_initialized() else 0
    if config.save_base_shapes:
        if rank == 0:
            write_base_shapes(config, config.base_shapes_file)
        said = f"wrote the muP base shapes to {config.base_shapes_file}"
    else:
        if rank == 0:
            coord_check(config, make_batches(), optimizer, lr, out_dir, device=device)
        said = f"wrote the muP coordinate check to {out_dir}/coord_check_up.png and coord_check_sp.png"
    if dist.is_initialized():
        dist.barrier()
    return said
