"""The model side of the engine: the paged KV cache, paged attention plugged into Hugging Face
models, the model runner (the only caller of the model) and its pool of captured CUDA graphs."""
