"""Every config that loads today resolves to the same values tomorrow (issue 20: "every GPT-NeoX
config that loads today still loads with the same resolved values").

The property is *unchanged by refactoring*, so the reference is our own earlier output: the snapshot
``tests/fixtures/resolved_snapshot.json`` was written from the resolved configs at main's commit
f7748b9, before the schema moved beside its components, and every later refactor is held to it. It
is not a statement that these values are right (other tests check that against GPT-NeoX's published
arguments, DeepSpeed and direct computations): a deliberate change of a resolved value regenerates
it (``python tests/unit/test_resolved_unchanged.py --write``) and says why in its commit.

What is compared, per config (each shipped ``configs/**/*.yml`` with ``configs/local_setup.yml``,
and every GPT-NeoX file set of ``test_neox_configs.py`` that passes its dry run), resolved as
``deepy.py --dry-run`` resolves it for a Slurm launch of 8 ranks (a world size that does not depend
on this machine): every key's value (as the values that differ from the schema's defaults, plus the
defaults themselves once), where each value came from (file:line, cli, derived), and the DeepSpeed
config handed to the engine. ``git_hash`` (the commit) and ``config_files`` (the input files' text)
are left out. In-process
(``parse_command`` -> ``resolve``, the path ``deepy.py`` takes), no subprocesses.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for --write, run as a script

from megatron.app.deepy import parse_command, resolve  # noqa: E402
from megatron.neox_arguments.arguments import NeoXArgs  # noqa: E402
from test_neox_configs import CASES, NEOX, SAVE_ONLY, SLURM  # noqa: E402
# resolved from an empty directory, as test_neox_configs.py's checks are (its autouse fixture, used here too)
from test_neox_configs import away_from_the_repository  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "tests" / "fixtures" / "resolved_snapshot.json"
VOLATILE = {"git_hash", "config_files"}
"""Left out: the commit of the code that runs, and the text of the input files (recorded with a run)."""
SAVE_ONLY_TEXT = '{"save": "checkpoints", "load": "checkpoints", "log_dir": "logs"}\n'


def cases(save_only: Path) -> Iterator[tuple[str, list[str]]]:
    """``(id, files)`` of every config that passes its dry run today."""
    for path in sorted((REPO / "configs").glob("**/*.yml")):
        if path.name != "local_setup.yml":
            rel = path.relative_to(REPO).as_posix()
            yield rel, [str(path), str(REPO / "configs" / "local_setup.yml")]
    for c in CASES:
        if not (c.unsupported or c.unknown or c.duplicate or c.overrides or c.problems):
            files = [str(save_only) if f == SAVE_ONLY else str(NEOX / f) for f in c.files]
            yield f"neox:{c.id}", files


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resolved_values(files: list[str], save_only: Path) -> dict[str, Any]:
    """What ``deepy.py --dry-run`` resolves ``files`` to, with no value that depends on this machine."""
    resolved = resolve(parse_command(["--dry-run", str(REPO / "train.py"), *files, *SLURM]))
    values = {k: v for k, v in resolved.args.model_dump(mode="json").items() if k not in VOLATILE}
    defaults = NeoXArgs().model_dump(mode="json")
    return {
        "values": {k: v for k, v in values.items() if k not in defaults or defaults[k] != v},
        "provenance": {k: str(v).replace(str(save_only), "<save-only>").replace(f"{REPO}/", "")
                       for k, v in resolved.provenance.items() if k not in VOLATILE},
        "deepspeed": _json(resolved.deepspeed_config),
    }


def snapshot(save_only: Path) -> dict[str, Any]:
    defaults = {k: v for k, v in NeoXArgs().model_dump(mode="json").items() if k not in VOLATILE}
    configs = {cid: resolved_values(files, save_only) for cid, files in cases(save_only)}
    return {"defaults": defaults, "configs": configs}


@pytest.fixture(scope="module")
def save_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("local") / "save_only.yml"
    path.write_text(SAVE_ONLY_TEXT)
    return path


@pytest.fixture(scope="module")
def stored() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


def test_schema_defaults_unchanged(stored: dict[str, Any]) -> None:
    """Every key of the snapshot keeps its default (none disappears); a key added since has a default of its own,
    which changes no earlier config's values (those are compared below, key by key)."""
    now = {k: v for k, v in NeoXArgs().model_dump(mode="json").items() if k not in VOLATILE}
    assert {k: now.get(k, "<removed>") for k in stored["defaults"]} == stored["defaults"]


def test_every_config_of_the_snapshot_still_loads(stored: dict[str, Any], save_only: Path) -> None:
    assert {cid for cid, _ in cases(save_only)} == set(stored["configs"])
    assert len(stored["configs"]) >= 55  # 25 shipped + the GPT-NeoX file sets that pass


def test_every_config_resolves_to_the_same_values(stored: dict[str, Any], save_only: Path) -> None:
    changed = {}
    for cid, files in cases(save_only):
        now = resolved_values(files, save_only)
        before = stored["configs"][cid]
        for part in ("values", "provenance", "deepspeed"):
            if now[part] != before[part]:
                keys = set(now[part]) | set(before[part])
                changed[f"{cid} {part}"] = {k: (before[part].get(k), now[part].get(k)) for k in sorted(keys)
                                            if before[part].get(k) != now[part].get(k)}
    assert not changed, json.dumps(changed, indent=1)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        only = Path(tmp) / "save_only.yml"
        only.write_text(SAVE_ONLY_TEXT)
        SNAPSHOT.write_text(json.dumps(snapshot(only), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT.relative_to(REPO)}")
