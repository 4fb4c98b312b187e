"""
liger-kernel's mHC and Block AttnRes ops beside ours on the same inputs: scripts/kernel_bench.py's optional section
(issue 68 item 7; docs/speed.md, "The maintained library beside ours"). It runs when `liger_kernel` imports; the
project does not depend on it. Not run on its own.

- mHC, one sublayer's connection: ours = depthbench.kernels.triton_hc_read.hc_read (maps, width mix, the branch's
  RMSNorm) + triton_hc.depth_connection (the write, from the mixed streams read made); theirs =
  liger_mhc_coeffs (fused norm + projection, split Sinkhorn) + liger_mhc_pre + the same RMSNorm module (theirs
  leaves it out) + liger_mhc_post_res (H_res's mix fused with the write, from the streams). The same connector
  parameters (phi, b, the alphas), streams and branch output; outputs (h, the new streams) and every gradient
  (streams, branch output, phi, b, alphas, the norm's gain) against each other; times forward and backward.
  liger_mhc_coeffs gets our eps (1e-6), 20 Sinkhorn iterations (theirs: tmax), pre_eps 0, post_mult 2: its defaults.
- Block AttnRes, the deepest chunk of consumers (kernel_bench_depth.attnres_case): theirs = liger_attn_res over
  torch.stack(the consumer's sources + its open sum) per consumer (their op takes one stacked (N, B, T, D) tensor;
  the open sum, fp32 in ours, is cast to the sources' bf16 to be stacked), against ops.DepthBank's mix; ours is
  kernel_bench_depth's block_attnres section (the same inputs and chunk): ms per consumer beside theirs.
- Full AttnRes: not timed. Their kernel unrolls next_power_of_2(N) source iterations (tl.static_range): 256 at the
  card's 141 sources (the docstring says up to 16 blocks).

On the GPU machine: the wheel is carried as an ignored path (.whl/, which .gitignore ignores) and installed by
scripts/gpu_smoke.py's environment check (`liger_wheel`: `pip install --no-deps .whl/liger_kernel-*.whl`, on a GPU
run, when liger_kernel does not import already):
    pip download liger-kernel==0.8.5 --no-deps -d .whl        # here, then run(carry=[".whl"]) on the device
On the CPU (--tiny): unzip the wheel into a private folder and put it on PYTHONPATH.
"""
from __future__ import annotations

import torch

import kernel_bench_depth as depth


def liger():
    """(liger_kernel.transformers.functional, version) where it imports, else (None, the reason)."""
    try:
        import liger_kernel
        from liger_kernel.transformers import functional
    except Exception as e:  # ImportError, or one of its optional imports failing: the section says why and is left
        return None, f"liger_kernel does not import: {type(e).__name__}: {e}"[:300]
    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib import metadata
        version = metadata.version("liger-kernel")
    return functional, version


def mhc_sides(functional, sub, device):
    """(ours, theirs): builds (kernel_bench_depth.Run factories) of one mHC sublayer's read + write on `sub`
    (kernel_bench.Sublayer)."""
    from depthbench.kernels import triton_hc as hc
    from depthbench.kernels import triton_hc_read_ops as hcr
    c = sub.site.conn
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    leaves = [sub.H, sub.y] + sub.params

    def ours():
        with autocast:
            h, _, post, _, mixed = hcr.hc_read(sub.res, sub.H, sub.site)
            return [h, hc.depth_connection(mixed, post, sub.y)]

    def theirs():
        with autocast:
            pre, post, res = functional.liger_mhc_coeffs(sub.H, c.phi, c.b, alpha_pre=c.alpha_pre,
                                                         alpha_post=c.alpha_post, alpha_res=c.alpha_res,
                                                         tmax=sub.res.sinkhorn_iters, rms_eps=1e-6)
            h = sub.site.norm(functional.liger_mhc_pre(sub.H, pre))
            return [h, functional.liger_mhc_post_res(sub.H, sub.y, post, res)]
    return (lambda: depth.Run(ours, leaves)), (lambda: depth.Run(theirs, leaves))


def compare(ours, theirs, device, repeat, warmup):
    """Both sides timed (kernel_bench_depth.measure) and checked against each other -> a section."""
    section = {}
    firsts = {}
    for name, build in (("ours", ours), ("theirs", theirs)):
        numbers, first, kernels = depth.measure(build, device, repeat, warmup)
        firsts[name] = first
        section[name] = {"forward_ms": numbers["forward_ms"], "backward_ms": numbers["backward_ms"],
                         "forward_host_ms": numbers["forward_host_ms"],
                         "backward_host_ms": numbers["backward_host_ms"], "kernels": kernels}
    (a_out, a_grad), (b_out, b_grad) = firsts["ours"], firsts["theirs"]
    section["outputs_agree"] = depth.agreement(b_out, a_out)
    section["gradients_agree"] = depth.agreement(b_grad, a_grad)
    for key in ("forward_ms", "backward_ms"):
        section[f"theirs_over_ours_{key[:-3]}"] = round(section["theirs"][key] / section["ours"][key], 3)
    return section


def block_attnres_theirs(functional, args, device):
    """Their mix over the Block chunk's stacked sources, timed, and checked against ops.DepthBank's on the same
    inputs -> a section (their ms per consumer beside kernel_bench_depth's block_attnres rows for ours)."""
    case = depth.attnres_case("block_attnres", args.tokens, args.d_model, args.tiny)
    sources, queries, gains, extras = depth.attnres_inputs(case, device)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def build():
        def forward():
            outs = []
            with autocast:
                for r, n in enumerate(case.reads):
                    V = torch.stack(sources[:n] + [extras[r].to(torch.bfloat16)])
                    outs.append(functional.liger_attn_res(V, queries[r], gains[r], eps=1e-5))
            return outs
        return depth.Run(forward, sources + [queries, gains] + extras)
    numbers, (outs, grads), kernels = depth.measure(build, device, args.repeat, warmup=0 if args.tiny else 2)
    reference = depth.attnres_build(case, (sources, queries, gains, extras), device, fast=False)()
    ref = reference.forward()
    ups = [torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(j)).to(r.dtype)
           for j, (o, r) in enumerate(zip(outs, ref))]
    ref_grads = torch.autograd.grad(ref, reference.leaves, ups, allow_unused=True)
    return {"consumers": len(case.reads), "reads": case.reads, "forward_ms": numbers["forward_ms"],
            "backward_ms": numbers["backward_ms"], "forward_host_ms": numbers["forward_host_ms"],
            "backward_host_ms": numbers["backward_host_ms"], "kernels": kernels,
            "forward_vs_reference": depth.agreement(outs, ref), "gradients_vs_reference": depth.agreement(grads, ref_grads)}


def section(args, device, sublayer, ours_block):
    """The liger section of kernel_bench's JSON: {version, mhc, block_attnres, attnres} or {reason}.
    sublayer: kernel_bench.sublayer (mHC's site at the card's shape); ours_block: kernel_bench_depth's block_attnres
    section, or None."""
    functional, version = liger()
    if functional is None:
        return {"reason": version}
    out = {"version": version, "attnres": {"reason": "not timed: their kernel unrolls next_power_of_2(N) sources "
                                           "(256 at the card's 141); documented for up to 16 blocks"}}
    warmup = 0 if args.tiny else 2
    ours, theirs = mhc_sides(functional, sublayer("mhc", args, device), device)
    out["mhc"] = compare(ours, theirs, device, repeat=args.repeat, warmup=warmup)
    theirs_block = block_attnres_theirs(functional, args, device)
    if ours_block is not None:
        for key in ("forward", "backward"):
            theirs_block[f"theirs_over_ours_{key}"] = round(theirs_block[f"{key}_ms"] / ours_block[key]["ms"], 3)
    out["block_attnres"] = theirs_block
    return out
