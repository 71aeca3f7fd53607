"""Plot training curves from one or several runs' ``metrics.jsonl`` into a PNG.

    python tools/plot_metrics.py logs -o curves.png                    # every run of a log_dir
    python tools/plot_metrics.py logs/20250101-120000-ab12 -o one.png  # one run (its folder or its file)
    python tools/plot_metrics.py runs/a runs/b -o compare.png          # several log_dirs overlaid
    python tools/plot_metrics.py logs --save checkpoints checkpoints_sft -o two.png   # the runs that saved there
    python tools/plot_metrics.py logs --ascii [--key train/lm_loss]    # a quick look in the terminal

Panels against the iteration, only for what the runs logged: one loss panel per kind of loss (a
language model's cross-entropy, pre-training and SFT alike, in nats per token; DPO's and KTO's loss per
pair or completion; a reward model's), each with its training, evaluation and test values; the
preference accuracy and reward margin of DPO/KTO/reward-model runs; learning rate, gradient norm, the
fp16 loss scale (fp16 runs only) and tokens per second. A training run keeps its rows and its
``deepy_config.json`` in one folder, ``<log_dir>/<run name>/``: each run is one colour, named after its
objective and config files (``DPO: tiny+dpo``), or the W&B run name when set (``--label`` overrides,
one per argument). ``--save DIR...`` keeps the runs whose checkpoints went to those directories (the ``save``
their ``deepy_config.json`` records), in that order: run names are launch times, a run's ``save`` is yours.
``--ascii`` prints one metric as a character chart instead, without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.errors import UsageError, run_guarded
from megatron.logging.metrics import METRICS_FILE, run_files

CONFIG_FILE = "deepy_config.json"

OBJECTIVES = {"lm": "LM", "sft": "SFT", "dpo": "DPO", "kto": "KTO", "rm": "RM"}
"""A run's objective, as its label names it."""

SPLITS = (("train", "-", "train"), ("eval", "o--", "eval"), ("test", "x", "test"))
"""(metric prefix, matplotlib style, legend word)."""


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[str, ...]
    """Metric names without the split prefix (``lm_loss``, ``rewards/accuracy``); ``train/lr``-style keys
    that exist for one split only are given whole, with ``whole`` set."""
    objectives: tuple[str, ...] = ()
    """Runs of these objectives only (empty: every run)."""
    scale: str = "linear"
    whole: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("cross-entropy loss (nats per token)", ("lm_loss",), ("lm", "sft")),
    Panel("DPO loss (per pair; ln 2 = 0.693 at the start)", ("lm_loss",), ("dpo",)),
    Panel("KTO loss", ("lm_loss",), ("kto",)),
    Panel("reward-model loss (per pair)", ("lm_loss",), ("rm",)),
    Panel("preference accuracy", ("rewards/accuracy", "rm/accuracy")),
    Panel("reward margin", ("rewards/margin", "rm/margin")),
    Panel("learning rate", ("train/lr",), whole=True),
    Panel("gradient norm (before clipping)", ("train/grad_norm",), scale="log", whole=True),
    Panel("fp16 loss scale", ("train/loss_scale",), scale="log", whole=True),
    Panel("tokens / s (all devices)", ("throughput/tokens_per_sec",), whole=True),
)


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    rows: list[dict[str, Any]]
    objective: str = "lm"
    """``lm``, ``sft``, ``dpo``, ``kto`` or ``rm`` (see :func:`objective_of`)."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                xs.append(int(row["iteration"]))
                ys.append(float(value))
        return xs, ys


def metrics_paths(path: Path) -> list[Path]:
    """The runs' files a command-line argument names: a file, a run's folder, or a log_dir's runs."""
    files = run_files(path)
    for file in files:
        if not file.is_file():
            raise UsageError(f"{file}: no such metrics file (give a log_dir, a run's folder or its {METRICS_FILE})")
    return files


def read_runs(path: Path, label: str | None = None) -> list[Run]:
    files = metrics_paths(path)
    if len(files) == 1:
        return [read_run(files[0], label)]
    return [read_run(file, f"{label}/{file.parent.name}" if label else None) for file in files]


def run_config(metrics_file: Path) -> dict[str, Any]:
    """The resolved arguments of the run beside its metrics (``deepy_config.json``), or {}."""
    try:
        data = json.loads((metrics_file.resolve().parent / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def objective_of(args: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """From the run's config when there is one (``train_impl``; SFT: label datasets), else from what it logged."""
    impl = args.get("train_impl")
    if impl in ("dpo", "kto", "rm"):
        return str(impl)
    if impl is not None:
        return "sft" if args.get("train_label_data_paths") else "lm"
    keys = {key for row in rows for key in row}
    if "train/rewards/accuracy" in keys:
        return "dpo"
    if "train/rewards/desirable" in keys:
        return "kto"
    if "train/rm/accuracy" in keys:
        return "rm"
    return "lm"


def auto_label(config: dict[str, Any], objective: str, fallback: str) -> str:
    """``DPO: tiny+dpo``: the objective and the stems of the config files (local_setup-style files that
    only say where things are left out), or the W&B run name when one is set."""
    args = config.get("args") or {}
    if args.get("wandb_run_name"):
        return str(args["wandb_run_name"])
    stems = [Path(name).stem for name in (args.get("config_files") or {})]
    stems = [s for s in stems if "setup" not in s] or stems
    return f"{OBJECTIVES[objective]}: {'+'.join(stems) if stems else fallback}"


def distinguish(runs: list[Run]) -> list[Run]:
    """Runs that would share a label get the command-line overrides that tell them apart, then their folder."""
    original = [run.label for run in runs]
    labels = list(original)
    for i, run in enumerate(runs):
        if original.count(run.label) == 1:
            continue
        config = run_config(run.path)
        cli = sorted(k for k, where in (config.get("provenance") or {}).items() if where == "cli")
        args = config.get("args") or {}
        extra = " ".join(f"{k}={args.get(k)}" for k in cli if k not in ("save", "load", "log_dir", "master_port"))
        labels[i] = f"{run.label} {extra}".strip()
    for i, run in enumerate(runs):
        if labels.count(labels[i]) > 1:
            labels[i] = f"{labels[i]} ({run.path.parent.name})"
    return [Run(label, run.path, run.rows, run.objective) for label, run in zip(labels, runs)]


def read_run(path: Path, label: str | None = None) -> Run:
    """One run: a metrics file, or a folder's newest run."""
    file = metrics_paths(path)[-1]
    rows: list[dict[str, Any]] = []
    for line_no, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{file}:{line_no}: not JSON ({err.msg})") from err
        if isinstance(row, dict) and "iteration" in row:
            rows.append(row)
    if not rows:
        raise UsageError(f"{file}: no metric rows")
    config = run_config(file)
    objective = objective_of(config.get("args") or {}, rows)
    fallback = file.resolve().parent.name or str(file)
    return Run(label or auto_label(config, objective, fallback), file, rows, objective)


def panel_lines(panel: Panel, run: Run) -> list[tuple[str, str, list[int], list[float]]]:
    """(style, legend word, xs, ys) of each line ``run`` contributes to ``panel``."""
    if panel.objectives and run.objective not in panel.objectives:
        return []
    out = []
    if panel.whole:
        for key in panel.metrics:
            xs, ys = run.series(key)
            if xs:
                out.append(("-", "", xs, ys))
        return out
    for prefix, style, word in SPLITS:
        for metric in panel.metrics:
            xs, ys = run.series(f"{prefix}/{metric}")
            if xs:
                out.append((style, word, xs, ys))
    return out


def drawn_panels(runs: list[Run]) -> list[Panel]:
    """The panels some run has values for, in :data:`PANELS` order."""
    return [panel for panel in PANELS if any(panel_lines(panel, run) for run in runs)]


def build_figure(runs: list[Run]) -> Any:
    """A matplotlib Figure with one axis per panel that has data (at most three columns)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    panels = drawn_panels(runs)
    if not panels:
        raise UsageError("none of the runs logged a metric this tool plots (losses, learning rate, throughput)")
    cols = {1: 1, 2: 2, 3: 3, 4: 2}.get(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows + 0.6), constrained_layout=True,
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, panel in zip(axes.flat, panels):
        values: list[float] = []
        labelled = 0
        for i, run in enumerate(runs):
            for style, word, xs, ys in panel_lines(panel, run):
                name = run.label if len(runs) > 1 else ""
                label = " · ".join(part for part in (name, word) if part)
                dense = style == "-" and len(xs) >= 30
                ax.plot(xs, ys, "-" if dense else style, color=f"C{i}", label=label or None,
                        markersize=6 if word == "test" else 3.5,
                        linewidth=1.4 if word != "eval" else 1.0)
                labelled += bool(label)
                values += ys
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if panel.scale == "log" and values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")  # only where the values span decades: a log axis over 0.5-0.8 reads badly
        if labelled > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title(runs), fontsize=12)
    return fig


def title(runs: list[Run]) -> str:
    if len(runs) == 1:
        return f"{runs[0].label}: {runs[0].rows[-1]['iteration']} steps"
    joined = ", ".join(run.label for run in runs)
    return joined if len(joined) <= 90 else f"{len(runs)} runs (see the legends)"


def write_png(runs: list[Run], out: Path) -> int:
    """Draw and save; returns the number of panels."""
    fig = build_figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    panels = len(fig.axes)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return panels


def render_ascii(points: list[tuple[int, float]], width: int, height: int) -> list[str]:
    """A scatter of the series on a width x height character grid, y labels on the left."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y1 = y0 + 1e-9
    grid = [[" "] * width for _ in range(height)]
    for x, y in points:
        col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (width - 1))
        row = round((y1 - y) / (y1 - y0) * (height - 1))
        grid[row][col] = "*"
    lines = []
    for r, cells in enumerate(grid):
        label = y1 - (y1 - y0) * r / (height - 1)
        lines.append(f"{label:9.4f} |{''.join(cells)}")
    lines.append(" " * 10 + "+" + "-" * width)
    lines.append(" " * 11 + f"{x0:<{width // 2}d}{x1:>{width - width // 2}d}  (iteration)")
    return lines


def saved_into(runs: list[Run], saves: Sequence[str]) -> list[Run]:
    """The runs of ``runs`` whose ``save`` (in their ``deepy_config.json``) is one of ``saves``, in that order; a
    directory no run saved into is an error (a misspelt name, or the run's log is elsewhere)."""
    def same(a: str, b: str) -> bool:
        return os.path.normpath(a) == os.path.normpath(b) or Path(a).resolve() == Path(b).resolve()

    chosen: list[Run] = []
    for save in saves:
        found = [run for run in runs if isinstance(saved := (run_config(run.path).get("args") or {}).get("save"), str)
                 and same(saved, save)]
        if not found:
            raise UsageError(f"--save {save}: no run of these logs saved into it (runs given: "
                             f"{', '.join(run.path.parent.name for run in runs) or 'none'})")
        chosen.extend(run for run in found if all(run is not had for had in chosen))
    return chosen


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="log_dir(s), run folder(s) or metrics.jsonl file(s)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default: curves.png)")
    parser.add_argument("--label", action="append", default=None, help="legend label per run argument, in order")
    parser.add_argument("--save", nargs="+", default=None, metavar="DIR",
                        help="only the runs whose checkpoints went to these directories (their `save`), in this order")
    parser.add_argument("--ascii", action="store_true", help="print --key as a character chart instead")
    parser.add_argument("--key", default="train/lm_loss", help="metric for --ascii")
    parser.add_argument("--width", type=int, default=72)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--debug", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    labels = args.label or []
    if labels and len(labels) != len(args.runs):
        raise UsageError(f"{len(labels)} --label for {len(args.runs)} runs: give one per run or none")
    runs = [run for i, path in enumerate(args.runs) for run in read_runs(path, labels[i] if labels else None)]
    runs = distinguish(saved_into(runs, args.save) if args.save else runs)
    if args.ascii:
        for run in runs:
            xs, ys = run.series(args.key)
            if not xs:
                raise UsageError(f"{run.path}: no rows with '{args.key}'")
            print(f"{run.label}: {args.key} over {len(xs)} logged steps")
            print("\n".join(render_ascii(list(zip(xs, ys)), args.width, args.height)))
            print(f"first {ys[0]:.4f}  last {ys[-1]:.4f}  min {min(ys):.4f}  change {ys[-1] - ys[0]:+.4f}")
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise UsageError(f"matplotlib is not importable ({err}): pip install -r requirements/requirements.txt, "
                         f"or use --ascii") from None
    out = args.output or Path("curves.png")
    panels = write_png(runs, out)
    print(f"wrote {out} ({panels} panels, {len(runs)} run{'s' if len(runs) > 1 else ''}: "
          f"{', '.join(run.label for run in runs)})")
    return 0


def cli() -> None:
    """The ``deepy-plot-metrics`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
