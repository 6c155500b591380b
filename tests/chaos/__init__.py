"""Chaos and soak runs of a whole local cluster (``make chaos``, ``make soak``; CI-sized runs in
tests/e2e/test_chaos.py)."""
