"""The arithmetic task of `vf_arith`, multi-turn: a wrong answer gets feedback and another try.

`env.name: verifiers:vf-arith-retry`. verifiers' loader takes this package's Env (exported in
`__all__`), which plays the one seat turn by turn (`Agent.interaction`): the model answers; while its
last \\boxed{} is not the reference and tries remain, the env sends a user turn ("... try again")
and the harness (verifiers' `null` chat loop, resumed on the whole conversation) answers again. The
task's reward scores the last reply. Every model call goes through the engine's endpoint, so the
episode trains as one sequence with the feedback turns masked.
"""

import verifiers.v1 as vf
from vf_arith.taskset import ArithHarness, ArithTaskset, boxed_number

FEEDBACK = "That is not the right number. Check the arithmetic and answer again with \\boxed{}."


class RetryEnv(vf.SingleAgentEnv):
    """One seat, up to `TRIES` answers per episode."""

    TRIES = 2

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as talk:
            segment = await talk.turn()  # the task's prompt speaks first
            for _ in range(self.TRIES - 1):
                if segment.terminated or boxed_number(segment.last_reply) == task.data.answer.strip():
                    break
                segment = await talk.turn(FEEDBACK)


__all__ = ["ArithHarness", "ArithTaskset", "RetryEnv"]
