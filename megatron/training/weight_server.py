"""``serve_model_weights``: hand a generation server pointers to the live weights, GPT-NeoX's protocol
(megatron/model/weight_server.py @ea7aefd8, called once from training.py:257 before the first step).

Each rank listens on ``localhost:port`` (:func:`rank_port`), accepts one connection and, for every entry of the
engine's ``state_dict()`` in order, sends one pickled dict describing the tensor and waits for the client's reply
(any bytes, up to 4096) before the next; the last dict has ``end: True``, then the connection closes. The dict holds
where the tensor lives, not its values: ``state_dict_key``, ``dtype``, ``tensor_size``, ``tensor_stride``,
``tensor_offset`` (in elements), ``storage_cls``, ``requires_grad`` (False), ``end`` and the storage's sharing
handle. On a GPU that is GPT-NeoX's, field for field: the eight values of ``storage._share_cuda_()`` as
``storage_device``, ``storage_handle``, ``storage_size_bytes``, ``storage_offset_bytes``, ``ref_counter_handle``,
``ref_counter_offset``, ``event_handle``, ``event_sync_required`` (what ``torch.multiprocessing.reductions.
rebuild_cuda_tensor`` takes). GPT-NeoX has no CPU path (``_share_cuda_`` needs CUDA); on the CPU Deepy sends torch's
shared-memory handle instead (``storage._share_filename_cpu_()``, which moves the storage into shared memory in
place): ``storage_device: "cpu"``, ``manager_handle``, ``storage_handle``, ``storage_size_bytes``, which
``torch.UntypedStorage._new_shared_filename_cpu`` opens in another process. Either way the client maps the very
memory the optimizer updates in place, so it reads the weights as they train without being sent them again.
"""

from __future__ import annotations

import logging
import pickle
import socket
import warnings
from typing import Any

import torch

from megatron.torch_internals import share_cpu_storage, share_cuda_storage

log = logging.getLogger("deepy")


def rank_port(ports: int | list[int], rank: int) -> int:
    """GPT-NeoX's ``start_server``: ``ports + rank`` for one port, ``ports[rank]`` for a list."""
    if isinstance(ports, int):
        return ports + rank
    return int(ports[rank])


def tensor_message(key: str, tensor: torch.Tensor, end: bool) -> dict[str, Any]:
    """The dict one tensor travels as (module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated; GPT-NeoX sends its class
        storage = tensor.storage()
    message: dict[str, Any] = {
        "state_dict_key": key,
        "dtype": tensor.dtype,
        "tensor_size": tensor.shape,
        "tensor_stride": tensor.stride(),
        "tensor_offset": tensor.storage_offset(),
        "storage_cls": type(storage),
        "requires_grad": False,
        "end": end,
    }
    if tensor.is_cuda:
        (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = share_cuda_storage(storage)
        message.update(storage_device=device, storage_handle=handle, storage_size_bytes=size_bytes,
                       storage_offset_bytes=offset_bytes, ref_counter_handle=ref_counter_handle,
                       ref_counter_offset=ref_counter_offset, event_handle=event_handle,
                       event_sync_required=event_sync_required)
    else:
        manager, handle, size_bytes = share_cpu_storage(tensor.untyped_storage())
        message.update(storage_device="cpu", manager_handle=manager, storage_handle=handle,
                       storage_size_bytes=size_bytes)
    return message


def send_state_dict(state_dict: dict[str, torch.Tensor], conn: socket.socket) -> None:
    """Every entry, one message each, each answered by the client before the next (GPT-NeoX's ``send_state_dict``)."""
    keys = list(state_dict)
    for i, key in enumerate(keys):
        conn.sendall(pickle.dumps(tensor_message(key, state_dict[key], end=i == len(keys) - 1)))
        conn.recv(4096)


def serve_once(model: Any, port: int) -> None:
    """Listen on ``localhost:port``, hand the first client to connect ``model.state_dict()`` and close: GPT-NeoX's
    ``start_server`` (blocks until a client has taken every tensor)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("localhost", port))
        server.listen(1)
        log.info("serve_model_weights: waiting for a generation server on localhost:%d", port)
        conn, addr = server.accept()
        with conn:
            state_dict = model.state_dict()
            send_state_dict(state_dict, conn)
        log.info("serve_model_weights: %d tensors handed to %s:%d", len(state_dict), *addr[:2])
