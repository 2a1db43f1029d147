"""An agent for tests/unit/test_verifiers.py, in a module of its own so its process imports little."""


def reports_env_id(client, prompt, env_id: str) -> float:
    """An agent that names env_id gets the ID of verifiers:ID (agent_main offers it)."""
    return 1.0 if env_id == "vf-arith" else 0.0
