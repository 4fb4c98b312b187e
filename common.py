"""
Helpers every script shares: command-line types, one-line errors, atomic writes, checkpoints, printing.

No torch at module level: plot.py imports this and must not pay for (or need) torch.
"""
import argparse
import json


def json_object(text):
    """argparse type: a JSON object, e.g. --residual-args '{"n_groups": 4}' (a design's `options`)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value
