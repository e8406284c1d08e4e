"""``python -m vericache.kernels``: build the native kernels now (``make install`` runs it)."""

import time

from vericache.kernels import cpu_kernels, packed_kernels

t0 = time.perf_counter()
cpu_kernels()
packed_kernels()
print(f"vericache kernels ready ({time.perf_counter() - t0:.1f} s)")
