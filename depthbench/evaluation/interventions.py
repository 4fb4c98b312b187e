"""
What diagnose.py does to a model besides skipping a block (the model's own `model(idx, skip=b)`): swapping the
weights of two blocks in place, for the permutation score (docs/diagnostics.md#interventions).
"""
import torch


def block_tensors(model, b):
    """{name: tensor} that block b owns: its attention and MLP weights, and the residual's own
    tensors of its two sublayers (norm gains, HC/mHC connectors, AttnRes mixers, MoDA's W_kv)."""
    own = {f"block.{n}": p for n, p in model.blocks[b].named_parameters()}
    for side, i in (("attn", 2 * b), ("mlp", 2 * b + 1)):
        own.update({f"{side}.{n}": t for n, t in model.res.sublayer_params(i).items()})
    return own


@torch.no_grad()
def swap_blocks(model, i, j):
    """Swap the weights of blocks i and j in place, twice restores the model (docs/diagnostics.md#interventions);
    -> the swap count. Tensors pair by name and shape (KEEL's block 0 has no attention post-norm: it stays);
    per-block constants (LNS' scales) move with the design's `swap_blocks`."""
    a, b = block_tensors(model, i), block_tensors(model, j)
    seen, n = set(), 0
    for name, ta in a.items():
        tb = b.get(name)
        keys = [(t.data_ptr(), tuple(t.shape), t.stride()) for t in (ta, tb)] if tb is not None else []
        if tb is None or ta.shape != tb.shape or keys[0] == keys[1] or seen & set(keys):
            continue  # a tensor under two names moves once (the reference swapped HC's shared modules twice)
        seen.update(keys)
        tmp = ta.clone()
        ta.copy_(tb)
        tb.copy_(tmp)
        n += 1
    model.res.swap_blocks(i, j)
    return n
