"""The benchmarks of moe-fold, as scripts (``python bench/gemm.py``) and as one suite
(``python -m bench``, :mod:`bench.suite`). Not installed with the package."""
