"""``python -m vericache.kernels``: build the native kernels now (``make install`` runs it); ``--all``: every
variant this CPU runs (``cpu.supported_isas``), as the tests that compare the builds' bits need them
(``make test`` runs it before the suite, so the suite's time is its tests', not a compiler's)."""

import argparse
import time

from vericache.kernels import packed_kernels
from vericache.kernels.cpu import best_isa, supported_isas
from vericache.kernels.linear_op import linear_op

parser = argparse.ArgumentParser(prog="python -m vericache.kernels", description=__doc__)
parser.add_argument("--all", action="store_true", help="every variant this CPU runs, not only the widest")
args = parser.parse_args()
t0 = time.perf_counter()
isas = supported_isas() if args.all else [best_isa()]
for isa in isas:
    packed_kernels(isa)
    linear_op(isa)
print(f"vericache kernels ready ({time.perf_counter() - t0:.1f} s; {', '.join(isas)} build{'s' if len(isas) > 1 else ''})")
