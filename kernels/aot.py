"""Compile the Triton kernels for a GPU architecture without a GPU (ahead of time).

``python -m tailspec.kernels.aot --arch 90`` compiles every kernel variant the launchers use
(verification; attention for fp32/bf16/fp16 caches, with and without tree masks and sliding
windows; the split-KV attention and its merge) to a cubin with Triton's bundled ``ptxas`` and
prints the cubin sizes as JSON. It checks
that the kernels are valid compiled Triton, which the CPU interpreter does not, and warms
Triton's cache on a build machine. Needs ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import json
import os

ATTENTION_DTYPES = ("fp32", "bf16", "fp16")
SCALARS = {"scale": "fp32", "softcap": "fp32"}


def _signature(kernel, pointer_types: dict[str, str], scalar_types: dict[str, str]) -> dict[str, str]:
    """Triton types of a kernel's arguments: declared constexprs, the given pointer and scalar
    types, ``*i32`` for other pointers and ``i32`` for other scalars."""
    sig = {}
    for param in kernel.params:
        if param.is_constexpr:
            sig[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            sig[param.name] = pointer_types.get(param.name, "*i32")
        else:
            sig[param.name] = scalar_types.get(param.name, "i32")
    return sig


def compile_kernels(
    arch: int, head_dim: int = 128, group: int = 4, dtypes: tuple[str, ...] = ATTENTION_DTYPES
) -> dict[str, int]:
    """Cubin size per kernel variant for ``sm_<arch>``, attention for the caches of ``dtypes``."""
    bad = [d for d in dtypes if d not in ATTENTION_DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty subset of {ATTENTION_DTYPES}, got {dtypes!r}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset (the kernels are interpreted)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._triton_attention import paged_attention_kernel
    from ._triton_verify import verify_trees_kernel

    target = GPUTarget("cuda", arch, 32)
    sizes = {}
    floats = {"target_probs_ptr": "*fp32", "draft_probs_ptr": "*fp32", "uniforms_ptr": "*fp64", "scratch_ptr": "*fp32"}
    verify = ASTSource(verify_trees_kernel, _signature(verify_trees_kernel, floats, {}), {"BLOCK_V": 1024})
    sizes["verify"] = len(triton.compile(verify, target=target, options={"enable_fp_fusion": False}).asm["cubin"])
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    for dtype in dtypes:
        for tree in (False, True):
            for window in (False, True):
                constexprs = {
                    "GROUP": group,
                    "HAS_TREE": tree,
                    "HAS_WINDOW": window,
                    "HAS_SINKS": False,
                    "HAS_SOFTCAP": False,
                    "BLOCK_Q": 16,
                    "BLOCK_N": 32,
                    "BLOCK_D": block_d,
                    "BLOCK_DV": block_d,
                }
                pointers = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}"}
                pointers |= {"out_ptr": "*fp32", "tree_mask_ptr": "*u8", "sinks_ptr": "*fp32"}
                signature = _signature(paged_attention_kernel, pointers, SCALARS)
                src = ASTSource(paged_attention_kernel, signature, constexprs)
                name = f"attention[{dtype}{',tree' if tree else ''}{',window' if window else ''}]"
                sizes[name] = len(triton.compile(src, target=target).asm["cubin"])
    sizes |= _split_kv(triton, target, ASTSource, head_dim, group, block_d)
    return sizes


def _split_kv(triton, target, source, head_dim: int, group: int, block_d: int) -> dict[str, int]:
    """The split-KV attention and its merge: decode (one new token per sequence) on fp32 (ieee
    dots) and bf16 caches, with sinks and a soft cap too (gpt-oss, Gemma 2), tree verification (17
    new tokens) on bf16; 16 splits (the split count only scales an offset)."""
    from ._triton_split_kv import merge_splits_kernel, split_kv_attention_kernel

    sizes = {}
    for dtype, ieee, new_tokens, tree, variants in (
        ("fp32", True, 1, False, False),
        ("bf16", False, 1, False, False),
        ("bf16", False, 1, False, True),
        ("bf16", False, 17, True, False),
    ):
        constexprs = {
            "GROUP": group,
            "NUM_SPLITS": 16,
            "HAS_TREE": tree,
            "HAS_WINDOW": False,
            "HAS_SINKS": variants,
            "HAS_SOFTCAP": variants,
            "IEEE": ieee,
            "BLOCK_M": max(16, 1 << (new_tokens * group - 1).bit_length()),
            "BLOCK_N": 64,
            "BLOCK_D": block_d,
            "BLOCK_DV": block_d,
        }
        pointers = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}"}
        pointers |= {p: "*fp32" for p in ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "sinks_ptr")}
        pointers |= {"tree_mask_ptr": "*u8"}
        src = source(split_kv_attention_kernel, _signature(split_kv_attention_kernel, pointers, SCALARS), constexprs)
        name = f"split_kv[{dtype},{new_tokens} new{',sinks,softcap' if variants else ''}]"
        sizes[name] = len(triton.compile(src, target=target).asm["cubin"])
    pointers = {p: "*fp32" for p in ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "out_ptr", "sinks_ptr")}
    for sinks in (False, True):
        constexprs = {"NUM_SPLITS": 16, "HAS_SINKS": sinks, "BLOCK_D": block_d}
        src = source(merge_splits_kernel, _signature(merge_splits_kernel, pointers, {}), constexprs)
        sizes[f"merge_splits{'[sinks]' if sinks else ''}"] = len(triton.compile(src, target=target).asm["cubin"])
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability without the dot (80: Ampere, 90: Hopper)"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--dtypes", default=",".join(ATTENTION_DTYPES), help="the attention caches' dtypes, comma-separated"
    )
    args = parser.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    print(json.dumps(compile_kernels(args.arch, args.head_dim, dtypes=dtypes), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
