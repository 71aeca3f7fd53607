"""Print the README's two Quick start commands, one per line, as .ci/run runs them.

They are the first two ```bash blocks after "## Quick start"; comment lines are dropped and a
command continued over several lines with a trailing backslash is joined into one line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def readme_commands(readme: str) -> list[str]:
    start = readme.index("## Quick start")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme[start:], re.S)[:2]:
        lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        commands.append(" ".join(line.rstrip().rstrip("\\").strip() for line in lines))
    return commands


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "README.md"
    print("\n".join(readme_commands(path.read_text())))
