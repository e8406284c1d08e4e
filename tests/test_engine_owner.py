"""The one thread that owns an engine (``engine.owner.EngineOwner``), on a stand-in engine: commands
run in order on its thread and before the next step, it steps only while there is work, an idle owner
takes no step until a command comes, and a failing step stops it only when ``on_error`` says so."""

from __future__ import annotations

import threading
import time

from vericache.engine.owner import EngineOwner


class Counter:
    """An engine stand-in: ``work`` steps left; each step takes one."""

    def __init__(self) -> None:
        self.work, self.steps, self.threads = 0, 0, set()

    def busy(self) -> bool:
        return self.work > 0

    def step(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        self.work -= 1


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_commands_run_in_order_then_the_engine_steps_while_busy():
    engine, seen = Counter(), []
    owner = EngineOwner("test-owner", engine.busy, engine.step, lambda exc: True, autostart=False)
    for i in range(3):
        owner.call(lambda i=i: seen.append((i, threading.current_thread().name)))
    owner.call(lambda: setattr(engine, "work", 4))
    assert owner.pending() == 4 and seen == []     # nothing runs before start()
    owner.start()
    wait_for(lambda: engine.steps == 4)
    assert seen == [(0, "test-owner"), (1, "test-owner"), (2, "test-owner")] and engine.threads == {"test-owner"}
    time.sleep(0.1)
    assert engine.steps == 4           # idle: no step until a command brings work
    owner.call(lambda: setattr(engine, "work", 1))
    wait_for(lambda: engine.steps == 5)
    owner.stop()
    assert not owner.running


def test_a_failing_step_goes_to_on_error_which_decides_whether_the_owner_goes_on():
    engine, errors = Counter(), []

    def broken_step():
        engine.step()
        raise RuntimeError("bookkeeping broke")

    def on_error(exc: Exception) -> bool:
        errors.append(str(exc))
        return len(errors) < 3            # gives up at the third

    owner = EngineOwner("failing-owner", engine.busy, broken_step, on_error)
    owner.call(lambda: setattr(engine, "work", 10))
    wait_for(lambda: owner.stopped)
    assert errors == ["bookkeeping broke"] * 3 and engine.steps == 3 and not owner.running
    owner.call(lambda: setattr(engine, "work", 10))   # a stopped owner runs nothing more
    time.sleep(0.05)
    assert engine.steps == 3


def test_a_command_that_raises_does_not_take_the_owner_down():
    engine, seen = Counter(), []
    owner = EngineOwner("sturdy-owner", engine.busy, engine.step, lambda exc: True)
    owner.call(lambda: 1 / 0)
    owner.call(lambda: seen.append("after"))
    wait_for(lambda: seen == ["after"])
    assert owner.running
    owner.stop()
