"""Speed against the tools users would pick instead, measured side by side in one run (`make bench`).

Each module prints a table of absolute figures and ratios and writes JSON; `--quick` runs a
seconds-long version so that tests/test_bench.py keeps the code from rotting. Timings are never
asserted in tests.
"""
