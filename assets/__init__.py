"""Shipped data: the tiny tokenizer, SFT policy and drafter LM (see assets/tiny/MODEL_CARD.md)."""
