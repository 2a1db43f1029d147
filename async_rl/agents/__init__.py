"""User agents through an OpenAI-compatible endpoint on each generator engine (docs/agents.md)."""
