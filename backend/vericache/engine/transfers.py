"""Offloaded VeriCache: a complete draft's full KV crosses the link into a device buffer, and its
verification may start before the last layers land. The link schedules (``engine.schedules``) decide
when each transfer starts; this module starts it and says when its verification can run."""

from __future__ import annotations

from vericache.engine.request import Request, State
from vericache.kv.full import FullKVCache


def start_transfer(loop, req: Request) -> bool:
    """Reserve a device buffer for the request's full KV and queue it on the link."""
    if req.state != State.DRAFTING or not req.round.complete:
        return False
    nbytes = loop.memory.verify_buffer_bytes(req)
    key = ("verify", req.id)
    if not loop.device.can_fit(nbytes, key):
        if not loop.requests.in_state(State.TRANSFERRING):  # no buffer will come back by itself
            loop.scheduler.make_room(nbytes, key, req)
        if not loop.device.can_fit(nbytes, key):
            return False  # no room for the buffer now; retry next step
    loop.device.resize(key, nbytes)
    cfg, loaded = loop.runner.cfg, loop.runner.loaded
    buf = FullKVCache(cfg, loaded.device, loaded.kv_dtype, capacity=req.full.length + req.round.k + 1,
                      layers=cfg.num_hidden_layers - loop.memory.resident_layers)
    req.transfer = loop.link.submit(req.full, req.full.length, buf, first_layer=loop.memory.resident_layers)
    loop.requests.set_state(req, State.TRANSFERRING)
    return True


def can_verify(loop, req: Request) -> bool:
    """Start verifying before the last layers land when, at the measured rates, they will land
    before the forward reaches them: r layers still in flight take r * t_link_layer, the forward
    spends (L - r) * t_verify_layer on the layers already there."""
    streamed = req.transfer.dst.layers
    done = req.transfer.layers_done()
    if done == streamed:
        return True
    if loop.schedule.verifies_in_turn:
        return req is min(loop.requests.in_state(State.TRANSFERRING), key=lambda r: r.id)
    ahead = loop.memory.resident_layers + done  # layers the forward can do without waiting
    rates = measured_rates(loop)
    if rates is None or loop.instruments.verify_layer_s <= 0 or ahead == 0:
        return False
    link_layer_s = req.full.nbytes() / loop.runner.cfg.num_hidden_layers / rates[0]
    return (streamed - done) * link_layer_s <= ahead * loop.instruments.verify_layer_s


def measured_rates(loop) -> tuple[float, float] | None:
    """(link bytes per second, seconds per draft step), measured so far; None before both exist."""
    stats = loop.link.stats if loop.link is not None else None
    step_s = loop.instruments.draft_step_s()
    if stats is None or stats.busy_s <= 0 or step_s is None:
        return None
    return stats.bytes_moved / stats.busy_s, step_s
