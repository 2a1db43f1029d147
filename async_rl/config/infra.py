"""The run's plumbing: buffer, weight sync, security, logging, Ray."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.base import _f, _Section


class BufferConfig(_Section):
    host: Annotated[
        str,
        _f("the interface the buffer's ZMQ sockets bind to, and the address peers connect to: 127.0.0.1 "
           "(loopback) on one machine; this node's IP, or 0.0.0.0 (every interface, peers are given the "
           "node's IP) for generators or learners on other nodes"),
    ] = "127.0.0.1"
    ingest_port: Annotated[int, _f("ZMQ PULL port for trajectories (0 = any free port)", ge=0, le=65535)] = 0
    serve_port: Annotated[int, _f("ZMQ ROUTER port serving batches to learner ranks (0 = any free)", ge=0, le=65535)] = 0
    max_frame_mb: Annotated[
        int,
        _f("largest accepted trajectory frame, MiB; bounds the buffer's memory per message (a larger "
           "part is dropped by ZMQ, a larger whole frame rejected as too_large). 0 = computed: one group "
           "of group_size x max_model_len tokens (x env.max_turns for an agent env: a split episode sends "
           "each segment) at 8 bytes each (plus a recorded MoE route, layers x top_k x 1-2 bytes, and a "
           "teacher's log-prob, 4) plus header, rounded up to MiB; a set value below that is refused at launch",
           ge=0),
    ] = 0


class WeightSyncConfig(_Section):
    backend: Annotated[
        Literal["auto", "gloo", "shm", "nccl", "cuda_ipc"],
        _f("weight transport: gloo (sockets, any host), shm (shared memory, one host), nccl (CuPy, "
           "CUDA tensors), cuda_ipc (one GPU region mapped by learner and generators on the same GPU; "
           "its checksum is computed on the GPU, no host copy); "
           "auto = on CUDA (a megatron learner on cuda), cuda_ipc when colocated and nccl when "
           "disaggregated; off CUDA shm on a local Ray, else gloo; nccl with placement=colocated is refused"),
    ] = "auto"
    wire_dtype: Annotated[
        Literal["", "float32", "bfloat16", "float16"], _f("cast floating weights to this dtype on the wire ('' = none)")
    ] = ""
    bucket_mb: Annotated[int, _f("size of one broadcast bucket, MiB", ge=1)] = 64
    host: Annotated[
        str, _f("address of learner rank 0 for the broadcast group rendezvous; 0.0.0.0 = its node's IP")
    ] = "127.0.0.1"
    port: Annotated[int, _f("rendezvous port of the broadcast group (0 = any free port)", ge=0, le=65535)] = 0
    timeout_s: Annotated[float, _f("a broadcast group that does not form or move in this time fails", gt=0)] = 120.0
    checksum: Annotated[
        Literal["full", "sampled", "off"],
        _f("update checksum: the sender hashes every MiB (xxh3-64) and sends the table; receivers check "
           "every chunk (full) or the last chunk of each bucket plus a random 1/32 (sampled, ~4x cheaper)"),
    ] = "sampled"
    delta: Annotated[
        Literal["auto", "on", "off"],
        _f("send only the weights whose value at the engines' precision changed since the version every engine "
           "holds (sparse patches, or dense where smaller); every new membership's first update, and the fall-back "
           "after a delta whose served checksum disagrees, are full. Costs one model at the wire dtype on the "
           "sender and in every engine worker. auto = on where the engines serve a lower precision than the "
           "learner's master weights (bf16 engines) and the weights cross hosts (gloo to a Ray cluster); off on "
           "one host (measured slower there than a full sync), for fp32 engines, LoRA and the CUDA backends; on with "
           "the nccl or cuda_ipc backend, learner.lora or no lower-precision wire dtype is refused"),
    ] = "auto"


class SecurityConfig(_Section):
    curve: Annotated[
        bool,
        _f("encrypt and authenticate the ZMQ data plane with CURVE keys made per run (engines and "
           "learner ranks get their own client keys); false only on a trusted network: it prints a warning"),
    ] = True


class WandbConfig(_Section):
    mode: Annotated[Literal["offline", "online", "disabled"], _f("wandb mode (offline needs no account)")] = "offline"
    project: Annotated[str, _f("wandb project name")] = "async_rl"


class LoggingConfig(_Section):
    run_dir: Annotated[str, _f("parent folder of run directories")] = "runs"
    run_name: Annotated[str, _f("run directory name ('' = timestamp)")] = ""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)


class RayConfig(_Section):
    address: Annotated[str, _f("Ray cluster address ('' = start a local Ray)")] = ""
    num_cpus: Annotated[int, _f("logical CPUs of a local Ray (0 = enough for the placement plan)", ge=0)] = 0
    actor_logs: Annotated[bool, _f("show the logs of Ray actors (vLLM, learner) on the console")] = False
