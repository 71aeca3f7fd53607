"""Levanter's mixtures of named sources: ``data.configs`` + ``data.train_weights`` (``LMMixtureDatasetConfig``).

Read from Levanter's code at 9263f81e (``src/levanter/data/text.py``, ``src/levanter/data/mixture.py``); the facts
and their lines are in ``docs/dialects.md``. A source with a positive weight in some stage becomes one
``train_data_paths`` entry (its ``train_urls`` as one jsonl brace pattern, tokenized into ``cache_dir`` as
``train_urls`` are), in the order of ``data.configs`` (Levanter's dataset index, text.py:1332-1342 and
mixture.py:83-88, which breaks its remainder ties); every source with ``validation_urls`` becomes one
``valid_data_paths`` entry, weighted or not (text.py:1301-1305, 1341 skips only training caches). The weights, a
dict or a list of ``[step, {name: weight}]``, become ``train_data_weights_schedule`` (a dict: one stage at step 0),
so the train split is Levanter's block-deterministic mixture (``megatron/data/mixture.py``) also when the weights
never change, with its rounding per ``mixture_block_size``.
"""

from __future__ import annotations

from typing import Any

from megatron.data.mixture_schedule import JSONL_SUFFIXES
from megatron.neox_arguments.dialects.common import Context, Refused, Rule, noted

_SINGLE_SOURCE = ("data.train_urls", "data.validation_urls", "data.id", "data.name", "data.stream", "data.format",
                  "data.text_key")
"""Fields of Levanter's single-source configs that ``LMMixtureDatasetConfig`` lacks (a source holds them there)."""

_SOURCE_FIELDS = frozenset({"train_urls", "validation_urls", "cache_dir", "tags", "format", "id", "name", "stream"})
"""Fields of ``UrlDatasetSourceConfig``/``HfDatasetSourceConfig`` (text.py:443-522@9263f81e)."""


def _unflatten(value: Any) -> dict[str, dict[str, Any]]:
    """``data.configs`` as ``{name: {field: value}}``; a flag ``--data.configs.web.train_urls`` arrives as the key
    ``web.train_urls`` (common.py's whole-mapping gathering)."""
    if not isinstance(value, dict):
        raise Refused("give a mapping of source name -> {train_urls, validation_urls, ...}")
    out: dict[str, dict[str, Any]] = {}
    for key, item in value.items():
        name, dot, field = str(key).partition(".")
        if dot and name not in value:
            out.setdefault(name, {})[field] = item
        elif not isinstance(item, dict):
            raise Refused(f"source {key!r} is {item!r}: give a mapping {{train_urls, validation_urls, ...}}")
        else:
            out.setdefault(str(key), {}).update(item)
    return out


def sources(ctx: Context) -> dict[str, dict[str, Any]]:
    return _unflatten(ctx.value("data.configs", {}))


def stages(ctx: Context) -> list[tuple[int, dict[str, float]]]:
    """``data.train_weights`` as ``[(step, {name: weight})]`` (a dict is one stage at step 0), checked as Levanter's
    ``__post_init__`` checks it (text.py:1148-1164@9263f81e) and as ``MixtureDataset`` reads it."""
    raw = ctx.value("data.train_weights")
    names = sources(ctx)
    if raw is None or raw == {} or raw == []:
        raise Refused("data.train_weights is not set, so no source has a weight: Levanter builds no training set "
                      "and its MixtureDataset raises 'Datasets cannot be empty' (mixture.py:66-67)")
    if isinstance(raw, dict):
        out = [(0, raw)]
    elif isinstance(raw, list):
        out = []
        for entry in raw:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], dict)
                    and isinstance(entry[0], int) and not isinstance(entry[0], bool)):
                raise Refused(f"entry {entry!r}: give [step, {{source: weight}}]")
            if entry[0] < 0:
                # rescale_mixture_schedule_for_batch_schedule gives a negative step the data offset -1
                # (mixture.py:331-334), which MixtureDataset's stage assertions reject (mixture.py:70-78)
                raise Refused(f"step {entry[0]}: a negative step becomes data offset -1, which Levanter's "
                              "MixtureDataset rejects (mixture.py:70-78, 331-334); give steps >= 0")
            out.append((int(entry[0]), entry[1]))
    else:
        raise Refused("give a mapping {source: weight} or a list of [step, {source: weight}] "
                      "(Levanter's ValueError, text.py:1163-1164)")
    for step, weights in out:
        unknown = [name for name in weights if str(name) not in names]
        if unknown:
            raise Refused(f"step {step} weights {unknown}, which data.configs does not name ({sorted(names)}); "
                          "Levanter requires the weights' names to be sources (text.py:1152-1162)")
        bad = {name: w for name, w in weights.items() if isinstance(w, bool) or not isinstance(w, (int, float))
               or w < 0}
        if bad:
            raise Refused(f"step {step}: weights {bad} are not numbers >= 0 "
                          "(Levanter's ValueError, mixture.py:175-176)")
        if sum(weights.values()) <= 0:
            raise Refused(f"step {step}: the weights sum to 0 (Levanter's ValueError, mixture.py:169-171)")
    return [(step, {str(name): float(w) for name, w in weights.items()}) for step, weights in out]


def weighted(ctx: Context) -> list[str]:
    """The sources a train mixture reads: a positive weight in some stage, in ``data.configs``' order."""
    schedule = stages(ctx)
    return [name for name in sources(ctx) if any(w.get(name, 0) > 0 for _, w in schedule)]


def shards_pattern(name: str, field: str, urls: Any) -> str:
    """A source's urls as one jsonl path or brace pattern: ``[a.jsonl.gz, b.{1..2}.jsonl.gz]`` ->
    ``{a,b.{1..2}}.jsonl.gz`` (the common suffix kept last, so the entry names jsonl shards)."""
    listed = [urls] if isinstance(urls, str) else list(urls or [])
    if not listed or not all(isinstance(url, str) and url for url in listed):
        raise Refused(f"source {name!r}: {field} {urls!r} is not a list of paths")
    suffix = next((s for s in sorted(JSONL_SUFFIXES, key=len, reverse=True) if all(u.endswith(s) for u in listed)),
                  None)
    if suffix is None:
        raise Refused(f"source {name!r}: {field} {listed} are not all jsonl shards of one kind "
                      f"({', '.join(JSONL_SUFFIXES)}); Deepy tokenizes the 'text' field of jsonl shards")
    if len(listed) == 1:
        return listed[0]
    stems = [url[: -len(suffix)] for url in listed]
    if any("," in _outside_braces(stem) for stem in stems):
        raise Refused(f"source {name!r}: a path in {field} holds a comma outside braces, which one brace pattern "
                      "of its shards cannot carry")
    return "{" + ",".join(stems) + "}" + suffix


def _outside_braces(text: str) -> str:
    depth, kept = 0, []
    for ch in text:
        depth += ch == "{"
        if depth == 0:
            kept.append(ch)
        depth -= ch == "}" and depth > 0
    return "".join(kept)


def _check_source(name: str, spec: dict[str, Any], trains: bool) -> None:
    extra = sorted(set(spec) - _SOURCE_FIELDS)
    if extra:
        raise Refused(f"source {name!r}: {extra} are not fields of Levanter's UrlDatasetSourceConfig/"
                      "HfDatasetSourceConfig (text.py:443-522)")
    if spec.get("id") is not None or spec.get("name") is not None:
        raise Refused(f"source {name!r} is a Hugging Face dataset (id/name), which would be downloaded; give its "
                      "local train_urls/validation_urls")
    fmt = dict(spec.get("format") or {})
    if fmt.get("type", "text") != "text" or fmt.get("text_key", "text") != "text":
        raise Refused(f"source {name!r}: format {fmt}: Deepy tokenizes the 'text' field of jsonl shards; chat and "
                      "supervised formats are not read")
    if trains and not spec.get("train_urls"):
        raise Refused(f"source {name!r} has a weight but no train_urls: Levanter would read a cache it built "
                      "before (text.py:1358-1368), whose format Deepy does not read; give its train_urls")


def _configs(value: Any, ctx: Context) -> dict[str, Any]:
    """``data.configs`` -> ``train_data_paths`` (weighted sources) and ``valid_data_paths`` (sources with
    validation_urls)."""
    beside = [path for path in _SINGLE_SOURCE if path in ctx.leaves]
    if beside:
        raise Refused(f"{', '.join(beside)} beside data.configs: not fields of Levanter's LMMixtureDatasetConfig "
                      "(text.py:1117-1145); give them inside a source")
    named = _unflatten(value)
    if not named:
        raise Refused("no source: Levanter's ValueError 'At least one dataset must be provided' (text.py:1148-1150)")
    trains = set(weighted(ctx))
    for name, spec in named.items():
        _check_source(name, spec, name in trains)
    train = [shards_pattern(n, "train_urls", named[n]["train_urls"]) for n in named if n in trains]
    valid = [shards_pattern(n, "validation_urls", spec["validation_urls"]) for n, spec in named.items()
             if spec.get("validation_urls")]
    return {"train_data_paths": train, **({"valid_data_paths": valid} if valid else {})}


def _train_weights(value: Any, ctx: Context) -> dict[str, Any]:
    """``data.train_weights`` -> ``train_data_weights_schedule``: one weight per train_data_paths entry per stage."""
    if "data.configs" not in ctx.leaves:
        raise Refused("train_weights weights the sources of data.configs, which is not set (Levanter's "
                      "'At least one dataset must be provided', text.py:1148-1150)")
    names = weighted(ctx)
    return {"train_data_weights_schedule": [[step, [w.get(n, 0.0) for n in names]] for step, w in stages(ctx)]}


def _stop_strategy(value: Any, ctx: Context) -> dict[str, Any]:
    if value == "restart":
        return noted("a source read to its end starts again (Deepy: the next epoch of its sample index)")
    raise Refused("Levanter's MixtureDataset supports only 'restart' and raises NotImplementedError for the others "
                  "(mixture.py:101-106)")


def _unset_or(reason: str) -> Rule:
    def rule(value: Any, ctx: Context) -> dict[str, Any]:
        if value is None or value == {}:
            return noted("unset")
        raise Refused(reason)
    return rule


MIXTURE_RULES: dict[str, Rule] = {
    "data.configs": _configs,
    "data.train_weights": _train_weights,
    "data.mixture_block_size": lambda v, ctx: {"mixture_block_size": v},
    "data.stop_strategy": _stop_strategy,
    "data.max_train_batches": _unset_or(
        "it cuts each named source to its first N x (the first step's batch) sequences (text.py:1284-1297); "
        "a per-source cut is not built"),
    "data.num_validation_sequences": _unset_or(
        "it moves the last N sequences of a source's training data into its validation set (text.py:1272-1282, "
        "1307-1324); not built: give the source validation_urls"),
    "data.target_budget": _unset_or(
        "simulated epoching cuts each source to int(len x experiment_budget / target_budget) sequences "
        "(text.py:1255-1270); a per-source cut is not built"),
    "data.experiment_budget": _unset_or(
        "simulated epoching cuts each source to int(len x experiment_budget / target_budget) sequences "
        "(text.py:1255-1270); a per-source cut is not built"),
}

KEEP_WHOLE = frozenset({"data.configs", "data.train_weights", "data.max_train_batches",
                        "data.num_validation_sequences"})
"""Mappings read whole by their rule."""

__all__ = ["KEEP_WHOLE", "MIXTURE_RULES", "shards_pattern", "sources", "stages", "weighted"]
