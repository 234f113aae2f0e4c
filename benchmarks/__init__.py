"""Side-by-side measurements of lightning_gradacc against Lightning's built-in accumulation.

Run ``python -m benchmarks`` (``--device cuda`` on a GPU, ``--quick`` for a smoke run).
The tables are in docs/benchmarks.md.
"""
