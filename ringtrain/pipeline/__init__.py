"""Pipeline schedules as plain data, plus their simulator, drawing, CLI and executor.

Names follow one vocabulary (pp_size, pp_rank, n_stages, virtual_stages, dp_size, dp_rank),
written out in grid.py; schedule actions are `ir.Op` members.
"""
