"""Tokenization spread over a Ray cluster, in input order, so the written dataset is byte-identical.

Two users: ``tools/datasets/preprocess_data.py --ray [ADDRESS|local]`` and the cache that ``train_urls`` /
``validation_urls`` are tokenized into (:func:`megatron.data.url_sources.materialize_urls`, key
``tokenize_ray_address``; Levanter builds that cache with Ray, ``src/levanter/store/cache.py``@9263f81e).

The driver (this process) reads the input and cuts it into chunks of lines; ``workers`` Ray actors, one CPU
each, parse and tokenize a chunk at a time; the driver writes their results **in chunk order**, so the
``.bin``/``.idx`` bytes are those of the single-machine path whatever the number of workers or the order
in which they finish. At most ``2 * workers`` chunks are in flight: memory stays bounded.

An address is what ``ray.init`` accepts (``host:port`` of a cluster started with ``ray start --head``,
``ray://host:10001``, ``auto``); ``local`` starts a private Ray instance on this machine for the run and
stops it at the end. ``ray start`` enables token authentication (Ray 2.60); a process that names the address
must then run with ``RAY_AUTH_MODE=token`` (Ray's ``worker.py`` sends the token only then, or when it finds the
cluster by itself with ``auto``). The actors import ``megatron`` (and the tokenizer's libraries) from their own Python:
every node of the cluster needs Deepy installed, as Levanter's nodes need Levanter.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from megatron.errors import DataError, DeepyError

LOCAL = "local"
"""The address that starts a private Ray instance on this machine instead of joining a cluster."""
RAY_PIN = "ray==2.60.0"
"""The tested release (requirements/requirements.txt)."""

S = TypeVar("S")
I = TypeVar("I")  # noqa: E741
R = TypeVar("R")


def require_ray(option: str) -> Any:
    """The ``ray`` module, or a DataError naming ``option`` (the flag or key that asked for Ray)."""
    try:
        # lazy: Ray is optional and heavy (~1 s to import); only --ray / tokenize_ray_address use it
        import ray
    except ImportError:
        raise DataError(f"{option} spreads tokenization over a Ray cluster, but Ray is not installed here: "
                        f"pip install '{RAY_PIN}' (requirements/requirements.txt), or drop {option} to "
                        "tokenize on this machine") from None
    return ray


@contextmanager
def ray_cluster(address: str, option: str, local_cpus: int | None = None) -> Iterator[int]:
    """Join the cluster at ``address`` (or start a private one for ``local``, with ``local_cpus`` CPUs);
    yields the number of CPUs the cluster offers. This process leaves (and a private instance stops) at the
    end. A process already connected (``ray.init`` called by its owner) keeps its connection."""
    ray = require_ray(option)
    if ray.is_initialized():
        yield int(ray.cluster_resources().get("CPU", 1))
        return
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    try:
        if address == LOCAL:
            ray.init(address="local", num_cpus=local_cpus or os.cpu_count() or 1, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise DataError(f"{option} {address}: cannot connect to a Ray cluster there ({err}); start one with "
                        f"`ray start --head` and pass the address it prints (a cluster with token authentication, "
                        f"Ray's default, also needs RAY_AUTH_MODE=token here), or use {option} {LOCAL}") from None
    try:
        yield int(ray.cluster_resources().get("CPU", 1))
    finally:
        ray.shutdown()


class _Worker(Generic[S, I, R]):
    """One actor: builds its state once (a tokenizer, options), then applies ``fn`` to chunk after chunk."""

    def __init__(self, setup: Callable[..., S], setup_args: tuple[Any, ...], fn: Callable[[S, I], R]) -> None:
        self.state = setup(*setup_args)
        self.fn = fn

    def run(self, item: I) -> R:
        return self.fn(self.state, item)


def ordered_map(setup: Callable[..., S], setup_args: tuple[Any, ...], fn: Callable[[S, I], R], items: Iterable[I],
                workers: int, option: str) -> Iterator[R]:
    """``fn(setup(*setup_args), item)`` for every item on ``workers`` Ray actors, yielded in the items' order.

    Needs a connection (:func:`ray_cluster`). Items go round-robin to the actors; at most ``2 * workers`` are
    in flight. A :class:`DeepyError` raised by ``fn`` (bad input at ``file:line``) is re-raised here as is."""
    ray = require_ray(option)
    # lazy: Ray is optional and heavy (~1 s to import); only --ray / tokenize_ray_address use it
    from ray.exceptions import RayTaskError

    actor_cls = ray.remote(num_cpus=1)(_Worker)
    actors = [actor_cls.remote(setup, setup_args, fn) for _ in range(max(1, workers))]
    pending: deque[Any] = deque()

    def result(ref: Any) -> R:
        try:
            value: R = ray.get(ref)
            return value
        except RayTaskError as err:
            if isinstance(err.cause, DeepyError):
                raise err.cause from None
            raise

    try:
        for n, item in enumerate(items):
            pending.append(actors[n % len(actors)].run.remote(item))
            if len(pending) >= 2 * len(actors):
                yield result(pending.popleft())
        while pending:
            yield result(pending.popleft())
    finally:
        for actor in actors:
            ray.kill(actor)
