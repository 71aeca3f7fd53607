"""Draw the loss curve of a run in the terminal (no plotting library needed).

    python tools/plot_metrics.py logs/metrics.jsonl [--key train/lm_loss] [--width 72] [--height 16]

Reads the ``metrics.jsonl`` the trainer writes (one JSON object per logged step) and prints an
ASCII chart of ``--key`` against ``iteration``, plus first/last/min values, so the README's
quick start can show that the loss falls without installing matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from megatron.errors import UsageError, run_guarded


def read_series(path: Path, key: str) -> list[tuple[int, float]]:
    if not path.is_file():
        raise UsageError(f"{path}: no such metrics file (did the run write to another log_dir?)")
    points: list[tuple[int, float]] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}:{line_no}: not JSON ({err.msg})") from err
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "iteration" in row:
            points.append((int(row["iteration"]), float(value)))
    if not points:
        raise UsageError(f"{path}: no rows with '{key}'")
    return points


def render(points: list[tuple[int, float]], width: int, height: int) -> list[str]:
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
    parser.add_argument("metrics", type=Path, help="path to metrics.jsonl")
    parser.add_argument("--key", default="train/lm_loss")
    parser.add_argument("--width", type=int, default=72)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    points = read_series(args.metrics, args.key)
    print(f"{args.key} over {len(points)} logged steps")
    print("\n".join(render(points, args.width, args.height)))
    first, last = points[0][1], points[-1][1]
    print(f"first {first:.4f}  last {last:.4f}  min {min(p[1] for p in points):.4f}  change {last - first:+.4f}")
    return 0


if __name__ == "__main__":
    run_guarded(main)
