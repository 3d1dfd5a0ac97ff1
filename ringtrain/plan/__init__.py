"""`ringtrain plan`: which strategy and grid is fastest here, and does it fit (costmodel.py)."""
