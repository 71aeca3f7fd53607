"""What ``save_base_shapes`` and ``coord_check`` do instead of training (GPT-NeoX ea7aefd8 megatron/training.py
``save_base_shapes`` and ``mup_coord_check``, with mup 1.0.0): write the muP base shapes file, or run muP's
coordinate check and plot it, then stop. The muP model itself is ``megatron/model/mup.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import mup
import numpy as np
import torch
import torch.distributed as dist

from megatron.model import GPTConfig, GPTModel
from megatron.model.mup import apply_base_shapes, model_shapes
from megatron.objectives import build_objective
from megatron.training.train_config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]
"""(tokens ``[b, s]``, targets ``[b * s]`` with -100 where nothing counts), as mup's get_coord_data reads them."""


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
    mup.make_base_shapes(base, delta, savefile=path)


def coord_check_widths(config: GPTConfig) -> list[int]:
    """GPT-NeoX's widths: ``num_attention_heads x 2**p`` for p in 2..8 (so every width splits into the heads)."""
    return [config.arch.heads * 2**p for p in range(2, 9)]


def coord_check(config: GPTConfig, batches: Sequence[Batch], optimizer: str, lr: float, out_dir: str | None,
                widths: Sequence[int] | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """mup's ``get_coord_data`` for models of each width, muP (``up``) and standard parametrisation (``sp``):
    ``len(batches)`` steps of mup's MuAdam/MuSGD (torch's Adam/SGD for sp) at ``lr``, the mean absolute value
    (``l1``) of every module's output before each step. Writes ``coord_check_up.png`` and ``coord_check_sp.png``
    (:func:`plot_coord_check`) to ``out_dir`` unless it is None; returns the two data frames by tag."""
    # lazy: pandas and seaborn come with mup's coord_check, imported only for a coordinate check
    from mup.coord_check import get_coord_data

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

    frames = {}
    for tag, use_mup in (("up", True), ("sp", False)):
        models = {width: lazy(width, use_mup) for width in widths or coord_check_widths(config)}
        frames[tag] = get_coord_data(models, list(batches), optimizer=optimizer, lr=lr, mup=use_mup,
                                     flatten_output=True, fix_data=False, nsteps=len(batches),
                                     cuda=device.type == "cuda", show_progress=False)
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)
            plot_coord_check(frames[tag], os.path.join(out_dir, f"coord_check_{tag}.png"),
                             f"{'muP' if use_mup else 'standard parametrisation'}: {optimizer}, lr={lr}")
    return frames


def plotted_module(name: str) -> bool:
    """The modules a plot shows: the logits (the whole model, ``""``), the embedding, each block's attention and
    MLP, and the final norm (mup's ``plot_coord_data`` shows every module, with a legend that hides the axes)."""
    parts = name.split(".")
    return name in ("", "embedding", "final_norm", "output_layer") or (
        len(parts) == 3 and parts[0] == "layers" and parts[2] in ("attention", "mlp"))


def plot_coord_check(df: Any, path: str, title: str) -> None:
    """mup's coordinate check plot: the mean absolute output (l1) of each module against the width, log-log, one
    panel per step, the legend beside them."""
    # lazy: matplotlib only for a coordinate check's plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as matplotlib above

    shown = df[df.module.map(plotted_module)]
    steps = sorted(shown.t.unique())
    fig, axes = plt.subplots(1, len(steps), figsize=(4.5 * len(steps) + 3, 4.5), squeeze=False)
    for ax, step in zip(axes[0], steps):
        at = shown[shown.t == step]
        for module in sorted(at.module.unique()):
            points = at[at.module == module].groupby("width").l1.mean()
            ax.plot(points.index, points.values, marker="o", label=module or "logits")
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
