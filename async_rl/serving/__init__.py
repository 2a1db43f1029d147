"""The serving layer, at the bottom of the rollout side: one typed interface over a vLLM engine
(`model.ServedModel`: generate from token ids with log-probs and policy versions, pause and resume,
receive weights, report health), the vLLM wrapper it is built on (`vllm_compat`), the worker
extension that loads weights inside vLLM's workers, sampling settings, LoRA serving and CPU thread
binding. The generator, the agents' endpoint and the LLM judge all serve their models through it."""
