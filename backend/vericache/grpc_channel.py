"""Options for the gRPC channels our clients open (the gateway's to Triton, a drafter's to each verifier).

gRPC's reconnect backoff grows to 120 s while a server is down: a gateway that started before a
slow-loading Triton stayed 503 ~27 s after Triton was ready (measured), and a drafter would leave a
restarted verifier unused for as long. Capped at 2 s, a server that comes back is seen within ~2 s.
"""

from __future__ import annotations

RECONNECT_BACKOFF = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000)]
