"""depthbench: the library the scripts at the root share (data checks, the run recipe, costs, distributed setup,
telemetry and trackers, the fast kernels, the authors' checkpoint layout, the mini suite's tables and figures).
A reader starts at the root (README.md, residuals.py, model.py, ops.py); nothing here is needed to understand a
design. This file imports nothing, so that plot.py (no torch) can use the figure modules."""
