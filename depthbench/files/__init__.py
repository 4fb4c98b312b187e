"""
depthbench/files: what the scripts read and write, and how they fail: the shared command line, one-line faults,
atomic writes and locks (common.py), run.json and a run folder's state (runlog.py), ckpt.pt read by type
(checkpoints.py) and the authors' released checkpoint layout (official.py). Imports no other sub-package.
"""
