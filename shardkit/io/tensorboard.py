"""TensorBoard event files of a run (``shardkit train --tensorboard DIR``), written with tensorboardX
by process 0 only, and read back (:func:`read_scalars`) for tests and notebooks.

Tags: ``train/loss``, ``train/learning_rate``, ``train/grad_norm``, ``train/tokens_per_s``,
``train/mfu`` (where the device has a published peak), ``eval/loss``, ``eval/perplexity`` and
``memory/per_device_mib`` (state and temporaries of the compiled step, logged once).

Example:
  >>> import tempfile
  >>> directory = tempfile.mkdtemp()
  >>> board = Scalars(directory)
  >>> board.write(1, {"train/loss": 2.5, "train/mfu": None})
  >>> board.close()
  >>> read_scalars(directory)
  {'train/loss': [(1, 2.5)]}
"""

from __future__ import annotations

import pathlib
import struct
from collections.abc import Mapping

from shardkit.core.config import check_tensorboard_available as check_available


class Scalars:
    """A TensorBoard writer of scalars by step."""

    def __init__(self, directory: str | pathlib.Path):
        check_available()
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(directory))

    def write(self, step: int, values: Mapping[str, float | None]) -> None:
        """One scalar per tag at ``step`` (tags whose value is None are left out)."""
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(directory: str | pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of every event file under ``directory`` (TFRecord framing:
    length, its crc, the Event proto, its crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(pathlib.Path(directory).rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((int(event.step), round(float(value.simple_value), 6)))
    return out
