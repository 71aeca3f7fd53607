"""Plot training curves from one or several runs' ``metrics.jsonl`` into a PNG.

    python tools/plot_metrics.py logs -o curves.png                    # every run of a log_dir
    python tools/plot_metrics.py logs/20250101-120000-ab12 -o one.png  # one run (its folder or its file)
    python tools/plot_metrics.py runs/a runs/b -o compare.png          # several log_dirs overlaid
    python tools/plot_metrics.py logs --ascii [--key train/lm_loss]    # a quick look in the terminal

Six panels against the iteration: training loss, evaluation loss, learning rate, gradient norm,
loss scale (fp16 runs; the others say so) and tokens per second. A training run keeps its rows in
``<log_dir>/<run name>/metrics.jsonl`` (a resumed run continues its own file), so a log_dir shared by
several runs shows each as its own curve. Each run is one colour, labelled by its folder (``--label``
overrides, one per argument). ``--ascii`` prints one metric as a character chart
instead, without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.errors import UsageError, run_guarded
from megatron.logging.metrics import METRICS_FILE, run_files

# (metric key, panel title, y-axis scale, what an empty panel says)
PANELS: list[tuple[str, str, str, str]] = [
    ("train/lm_loss", "training loss", "linear", "no training loss logged"),
    ("eval/lm_loss", "evaluation loss", "linear", "no evaluation (eval_interval / eval_iters)"),
    ("train/lr", "learning rate", "linear", "no learning rate logged"),
    ("train/grad_norm", "gradient norm (before clipping)", "log", "no gradient norm logged"),
    ("train/loss_scale", "fp16 loss scale", "log", "no loss scale: only fp16 runs scale the loss"),
    ("throughput/tokens_per_sec", "tokens / s (all devices)", "linear", "no throughput logged"),
]


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    rows: list[dict[str, Any]]

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
    return Run(label or (file.parent.name if file.parent.name else str(file)), file, rows)


def build_figure(runs: list[Run]) -> Any:
    """A matplotlib Figure with one axis per entry of :data:`PANELS`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (key, title, scale, empty) in zip(axes.flat, PANELS):
        drawn = False
        for i, run in enumerate(runs):
            xs, ys = run.series(key)
            if not xs:
                continue
            style = "o-" if len(xs) < 30 else "-"
            ax.plot(xs, ys, style, color=f"C{i}", label=run.label, markersize=3, linewidth=1.3)
            drawn = True
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(True, alpha=0.3)
        if drawn:
            if scale == "log" and all(y > 0 for run in runs for y in run.series(key)[1]):
                ax.set_yscale("log")
            if len(runs) > 1:
                ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("training curves: " + ", ".join(f"{run.label} ({run.path})" for run in runs), fontsize=11)
    return fig


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="log_dir(s), run folder(s) or metrics.jsonl file(s)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default: curves.png)")
    parser.add_argument("--label", action="append", default=None, help="legend label per run, in order")
    parser.add_argument("--ascii", action="store_true", help="print --key as a character chart instead")
    parser.add_argument("--key", default="train/lm_loss", help="metric for --ascii")
    parser.add_argument("--width", type=int, default=72)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    labels = args.label or []
    if labels and len(labels) != len(args.runs):
        raise UsageError(f"{len(labels)} --label for {len(args.runs)} runs: give one per run or none")
    runs = [run for i, path in enumerate(args.runs) for run in read_runs(path, labels[i] if labels else None)]
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
    print(f"wrote {out} ({panels} panels, {len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


def cli() -> None:
    """The ``deepy-plot-metrics`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
