"""ATTS on the tiny chain-sum task: the shipped drafter LM writes chunks, the shipped policy scores
them and takes over per the conformal rule; compared with target-only sampling and the synchronous
baseline in one run (same as `tailspec atts`; pass its options, e.g. --alpha 0.3 --ray).

python examples/atts_tiny_task.py --questions 16 --samples 8 --alpha 0.2
"""

import sys

from tailspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["atts", *sys.argv[1:]]))
