"""The OpenAI-compatible endpoint over a served model, above the serving layer and below its two
clients: the agents (docs/agents.md: every call recorded token in / token out into its episode's
log) and the LLM judge (reward_models/judge_engine.py: calls recorded nowhere). Its parts: the
endpoint and its backend over a `ServedModel` (`endpoint.py`), chat rendering with the model's own
template and reply parsing (`rendering.py`), the request and reply types (`openai_types.py`),
server-sent events (`streaming.py`) and the per-episode call log (`episode_log.py`)."""
