"""``make gpu-check``: the CUDA paths proven in one call on a lent GPU (``make gpu-rehearse`` on CPU).

Stages run one after another, each in a child process with its own time budget (a hang or a crash
in one costs only that stage): ``env`` (versions, copy bandwidth, matrix rate, the engine imported
without the trainer stack), ``correctness`` (greedy equality with HF ``generate`` for every
strategy on two architectures, the chi-square test, bf16 divergence against a batch-1 control),
``graphs`` (the captured-graph pool), ``kernels`` (Triton against torch references), ``speed``
(the deep policy grown to about 1B parameters) and ``gpu_tests`` (every ``gpu``-marked test).
Results land in ``OUT``: ``results.json``, ``log.txt`` and ``summary.md``; the table is printed
last. docs/GPU.md records what ran where.
"""
