"""The files of one checkpoint written by a thread while training goes on (``async_save``).

DeepSpeed's engine hands every file of a save to its checkpoint engine's ``save(state_dict, path)``;
for the length of one save that call is replaced by a serialization into host memory, exactly as
``TorchCheckpointEngine.save`` would write the file (``torch.save``, the engine's zipfile setting): the
tensors are copied off the devices there, so training may change them as soon as the save returns.
A thread then writes each buffer to its path, fsyncs it and checks the size on disk; the commit
(``save_load.commit_checkpoint``) waits for that and agrees with every rank before the marker.

DeepSpeed's own background engines (``DecoupledCheckpointEngine``, ``FastCheckpointEngine``) need its
``async_io`` op, which a CPU install does not build; Megatron-Core's ``--async-save`` and torchtitan's
``checkpoint.async_mode`` copy to host and write in the background the same way, for their own formats.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from megatron.deepspeed_internals import OtherCheckpointEngine, checkpoint_writes_to
from megatron.errors import CheckpointError

log = logging.getLogger("deepy.checkpoint")


class BackgroundWrites:
    """One rank's files of one save: serialized by the training thread, written by a thread of their own."""

    def __init__(self) -> None:
        self.files: list[tuple[str, bytes]] = []
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def capturing(self, engine: Any) -> Iterator[None]:
        """Serialize instead of write, for the duration of one ``engine.save_checkpoint``."""
        zipfile = [False]

        def serialize(state_dict: Any, path: str) -> None:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer, _use_new_zipfile_serialization=zipfile[0])
            self.files.append((str(path), buffer.getvalue()))

        try:
            with checkpoint_writes_to(engine, serialize) as zipfile[0]:
                yield
        except OtherCheckpointEngine as err:
            raise CheckpointError(f"async_save: DeepSpeed's checkpoint engine here is {err}; background saves write "
                                  "what its TorchCheckpointEngine writes. Set async_save: false") from None

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.files)

    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._write, name=f"deepy-save-{name}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            for path, data in self.files:
                with open(path, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                written = os.stat(path).st_size
                if written != len(data):
                    raise OSError(f"{path}: {written} bytes on disk, {len(data)} written")
        except BaseException as err:  # noqa: BLE001 - reported by wait() on the training thread
            self.error = err
        finally:
            self.files = []  # the buffers' memory goes back as soon as they are on disk

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
        return self.error
