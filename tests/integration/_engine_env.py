"""Environment for the vLLM engines of tests whose subject is what a run computes (learning, numerics,
data), not its processes.

VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core runs its one CPU worker in its own process
instead of spawning a second process that imports vLLM and torch again (the engine core itself stays
a separate process). Measured with the quickstart on the 2-core machine: ~9 s less per engine start
and stop, and a test starts one engine or more. Tests about processes (kills, Ctrl-C, affinity,
elastic pools: test_training_run, test_elastic, test_faults, test_launch_cli, test_resume) keep the
layout of a user's run (engine core + worker process).
"""

FAST_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
