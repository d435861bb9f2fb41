"""tailspec: lossless adaptive speculative rollouts for RL on reasoning LLMs."""
