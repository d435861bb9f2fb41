"""A speculative decode step's pieces: drafts fitted to sequences and KV blocks, lossless
verification, the four step functions (propose, verify, accept, commit), the length budget."""
