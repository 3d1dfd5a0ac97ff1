"""Benchmarks: contenders alternate in rounds inside one run; medians, ranges and ratios."""
