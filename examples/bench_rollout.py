"""Every benchmark section, as `make bench` runs them (docs/BENCHMARKS.md).

python examples/bench_rollout.py [--quick]
"""

import argparse
from pathlib import Path

from tailspec.benchmarks.sections import run_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="docs/BENCHMARKS.md")
    args = parser.parse_args()
    print(run_bench(Path(args.out), quick=args.quick))
