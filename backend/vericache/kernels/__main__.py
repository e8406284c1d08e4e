"""``python -m vericache.kernels``: build the native kernels now (``make install`` runs it)."""

import time

from vericache.kernels import packed_kernels
from vericache.kernels.linear_op import linear_op

t0 = time.perf_counter()
packed_kernels()
op = linear_op()
print(f"vericache kernels ready ({time.perf_counter() - t0:.1f} s; {op.isa} build)")
