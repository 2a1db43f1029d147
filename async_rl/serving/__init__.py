"""The serving layer, at the bottom of the rollout side: one typed interface over a vLLM engine
(`model.ServedModel`: generate from token ids with log-probs and policy versions, pause and resume,
receive weights, report health), the vLLM wrapper it is built on (`vllm_compat`), the worker
extension that loads weights inside vLLM's workers, sampling settings, LoRA serving and CPU thread
binding. The generator and the OpenAI-compatible endpoint (`async_rl.endpoint`, the agents' and the LLM
judge's) serve their models through it."""
