"""
depthbench/evaluation: what a model is scored on and how: the synthetic task and its answer metrics, diagnose.py's
calibration windows, its observed forward (observe.py) and interventions, the downstream NLL, the zero-shot harness
(lm-eval) and the paired comparison of a design against Pre-LN (compare.py). Imports files/ only.
"""
