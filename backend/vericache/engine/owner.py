"""The one thread that owns an ``Engine`` for a server: the background service (gateway, Triton model)
and the verifier role both run one.

An ``Engine`` is not thread-safe: exactly one thread adds requests, steps and aborts. Callers on other
threads hand it commands (plain callables, run on the owner's thread in the order queued); between
commands the owner steps the engine while it has work (``busy``), and waits for the next command when it
has none (no polling: ``stop`` wakes it). A step that raises goes to ``on_error``, which fails what it
must and says whether the owner goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("vericache.engine")

Command = Callable[[], None]


class EngineOwner:
    def __init__(self, name: str, busy: Callable[[], bool], step: Callable[[], None],
                 on_error: Callable[[Exception], bool], autostart: bool = True) -> None:
        """``busy()``: the engine has work to step; ``step()``: one step and what follows it (deliver its
        outputs, its events); ``on_error(exc)``: a step raised: fail what it concerns, return False to
        stop for good. ``autostart=False``: commands queue until ``start()``."""
        self._busy, self._step, self._on_error = busy, step, on_error
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if autostart:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def call(self, command: Command) -> None:
        """Run ``command`` on the owner's thread, after those queued before it."""
        self._commands.put(command)

    def pending(self) -> int:
        """Commands queued and not yet run."""
        return self._commands.qsize()

    @property
    def running(self) -> bool:
        """The thread is alive and has not been stopped (by ``stop`` or an ``on_error`` that gave up)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the command or step in progress (commands still queued are dropped)."""
        self._stop.set()
        self._commands.put(None)   # wakes an idle owner
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands(wait=not self._busy())
            if self._stop.is_set() or not self._busy():
                continue
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - the step itself broke: on_error fails what it holds
                log.exception("%s: engine step failed", self._thread.name)
                if not self._on_error(exc):
                    self._stop.set()

    def _run_commands(self, wait: bool) -> None:
        """Run every queued command; ``wait``: block for the first one (the engine has nothing to step)."""
        while not self._stop.is_set():
            try:
                command = self._commands.get() if wait else self._commands.get_nowait()
            except queue.Empty:
                return
            wait = False
            if command is None:
                continue
            try:
                command()
            except Exception:  # noqa: BLE001 - a command answers its caller itself; one that raises is a bug
                log.exception("%s: a command failed", self._thread.name)
