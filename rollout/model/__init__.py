"""The model side of the engine: the paged KV cache, paged attention plugged into Hugging Face
models, the model runner (every forward of a rollout) and its pool of captured CUDA graphs."""
