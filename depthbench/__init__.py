"""
depthbench: the library the scripts at the root share (docs/contributing.md#where-things-live), a sub-package per
concern: training/ (the run recipe, costs, distributed setup, telemetry), evaluation/ (what a model is scored on: the
synthetic task, diagnose.py's windows and observed forward, NLL, zero-shot, paired comparisons), reports/ (figures and
tables), files/ (the command line, run.json, checkpoints, the official layout) and kernels/ (the fast bodies of ops.py's
maths: CPU and Triton). A reader starts at the root (README.md, residuals.py, model.py, ops.py); nothing here is needed
to understand a design. This file imports nothing, so that plot.py (no torch) can use the figure modules.
"""
