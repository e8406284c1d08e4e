"""VeriCache's research harness: benchmarks (``bench``), the GPU simulator and calibration (``sim``),
quality evaluations (``eval``), training the bundled model (``train``) and its data (``data``), the
shaped network lab (``netlab``), the cost model's predictions (``predict``), the demo and the reports.

A client of the core library (``vericache``): it builds engines through ``vericache.Engine`` /
``vericache.LLM`` and reads the core's parts it measures; the core never imports it
(``tests/test_structure.py``). Its commands join ``vericache``'s through an entry point (``cli``).
"""
