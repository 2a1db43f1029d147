"""async_rl: asynchronous RL post-training of LLMs with disaggregated vLLM generators."""

__version__ = "0.1.0"
