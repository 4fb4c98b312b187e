"""
depthbench/reports: the figures and tables drawn from what the runs wrote: what every figure shares (drawing.py: the
JSON schemas, the look, the panel helpers, the command line), the evaluation figures plot.py registers, the mini
suite's figures, tables and shape fit, the telemetry figures, and compiled_code.py (the text of a compiled Triton
kernel read: scripts/kernel_probe.py's). No torch: plotting works where only the JSON is.
Imports evaluation/ (compare.py) and files/.
"""
