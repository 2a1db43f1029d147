"""Reward models served beside the generator pool: an LLM judge (vLLM engines of its own) and a
sequence-classification reward model (a batching Ray actor). See docs/reward-models.md."""
