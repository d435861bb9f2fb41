"""Mirror speculative decoding: the pipeline that drafts the next round while the target
verifies this one, the engine's slot for it, and the executors the drafter runs on."""
