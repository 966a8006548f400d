"""The sections of bench/perf.py, one module each; each registers itself (common.section)."""
