"""The engine's events as JSON lines (``vericache serve --trace FILE``): one record per event with
its wall-clock ``end`` (and ``seconds`` where it lasted), so the processes of a deployment can be laid
on one timeline (``bench prefix`` reads them for its plot and the roles' busy shares)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

Sink = Callable[[str, dict], None]


class TraceFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)   # line-buffered: a killed process loses no whole line
        self._lock = threading.Lock()

    def __call__(self, event: str, fields: dict) -> None:
        record = {"event": event, "end": time.time(), **fields}
        with self._lock:
            self._file.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


def tee(*sinks: Sink | None) -> Sink:
    """One sink that hands every event to each of ``sinks`` (None ones skipped)."""
    live = [s for s in sinks if s is not None]

    def sink(event: str, fields: dict) -> None:
        for s in live:
            s(event, fields)
    return sink


def read_trace(path: str) -> list[dict]:
    """A trace file's records (a missing file: none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
