"""Environment for the vLLM engines of the integration tests.

VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core runs its one CPU worker in its own process
instead of spawning a second process that imports vLLM and torch again (the engine core itself stays
a separate process, so killing it is still killing "vLLM's engine core"). This is the layout vLLM
uses on a GPU with tensor_parallel_size 1 (the `uni` executor); on CPU a user's run gets the `mp`
executor (engine core + worker process). Measured with the quickstart on the 2-core machine: ~9 s
less per engine start and stop, and a test starts one engine or more (the elastic and fault tests
start three or four). The tests that start runs as a user does, in subprocesses (test_launch_cli's
Ctrl-C and orphan checks, test_resume), keep the CPU layout.
"""

FAST_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
