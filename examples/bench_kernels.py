"""Triton kernels vs their torch paths, and engine tokens/s with and without them (needs CUDA).

python examples/bench_kernels.py [--quick] [--out docs/BENCHMARKS_KERNELS.md]
python examples/bench_kernels.py --interpret   # CPU smoke run in Triton's interpreter (timings meaningless)
"""

import argparse
import os
import sys

if "--interpret" in sys.argv:  # must be set before the first kernel compiles
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tailspec.benchmarks.kernels import kernels_section, measure_engine, run_kernel_bench  # noqa: E402
from tailspec.benchmarks.run import task_prompts  # noqa: E402
from tailspec.rollout import SamplingParams  # noqa: E402
from tailspec.tasks.sft import load_tiny, load_tiny_eagle3  # noqa: E402
from tailspec.testing import tiny_random_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--interpret", action="store_true", help="run on CPU in Triton's interpreter (smoke test)")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.interpret:
        print("no CUDA device: the kernel benchmark needs a GPU (or --interpret for a CPU smoke run)")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or args.interpret
    policy, tokenizer = load_tiny("policy")
    policy = policy.to(device)
    head = load_tiny_eagle3().to(device)
    prompts = task_prompts(tokenizer, 2 if args.interpret else 64, seed=0)
    timings, engine = run_kernel_bench(device, policy, prompts, [tokenizer.eos_token_id], head, quick)
    if device.type == "cuda" and not quick:  # a model with realistic head shapes (random weights)
        wide = tiny_random_model("qwen3", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8)
        wide = wide.to(device, torch.bfloat16)
        prompts = [[(7 * i + j) % 90 + 2 for j in range(64)] for i in range(64)]
        params = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
        engine += measure_engine(wide, prompts, params, ("none",), eos_token_ids=[1])
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU, Triton interpreter (smoke run)"
    section = kernels_section(timings, engine, name)
    print(section)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Triton kernel benchmarks\n\nWritten by `python examples/bench_kernels.py`.\n\n" + section + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
