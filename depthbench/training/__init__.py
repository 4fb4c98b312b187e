"""
depthbench/training: what train.py does besides the model: the run recipe (recipe.py: the command line resolved into
a RunConfig), the LR schedules, what a run costs (costs.py: memory plan, FLOPs), the distributed setup and
torch.compile, the telemetry recorded during training and the trackers that mirror it, the stop on a signal, the
progress line. Imports evaluation/ (telemetry reads the model through its observe.py), files/ and kernels/; never
reports/.
"""
