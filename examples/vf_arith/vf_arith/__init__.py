"""A verifiers 0.4 environment of our own: arithmetic word problems answered in \\boxed{}.

`env.name: verifiers:vf-arith` (docs/agents.md, 'verifiers environments'): verifiers'
loader imports this package by its ID, takes its Taskset (exported in `__all__`) and its Harness:
verifiers' `null` chat loop (one model call per turn, no tools: single-turn). The prompts and
references come from our `task.name` (see async_rl/agents/verifiers_bridge.py); `load()` holds a
few of its own rows for `vf-eval` and for prompts that name a row (`metadata.vf_idx`).
"""

from vf_arith.taskset import ArithHarness, ArithTaskset

__all__ = ["ArithHarness", "ArithTaskset"]
