"""Dry run of a plan at its real world size, on PyTorch's fake process-group backend.

`dry_run(plan, ranks)` (run.py) measures sampled ranks built and stepped by the trainer's own
code (build.py, measure.py) in a fake world (world.py), counting collectives (`runtime.comm_count`), and
compares them with the cost model (compare.py, `tessera.cost.collectives`).
"""
