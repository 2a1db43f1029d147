"""Multi-turn environments: the Environment interface, tool calls and tools, the sandbox, games."""
