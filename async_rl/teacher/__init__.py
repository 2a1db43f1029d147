"""On-policy distillation's teacher: vLLM replicas beside the generator pool (started, watched and
restarted like the reward-model replicas) that score every sampled token; the engines' scorer that
calls them before a group is pushed; the tokenizer check at start; the per-step teacher metrics."""
