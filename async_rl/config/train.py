"""The training loop: steps, staleness, syncs, checkpoints, recovery; supervised fine-tuning."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.base import _f, _Section


class TrainConfig(_Section):
    mode: Annotated[
        Literal["rl", "sft"],
        _f("rl: reinforcement learning (generators, buffer, learner); sft: supervised fine-tuning of the learner alone "
           "on chat demonstrations (the sft section; loss on assistant tokens only), with the torch backend's packing, "
           "checkpoints and resume (megatron and learner.lora are refused); an RL run then starts from its "
           "checkpoint's model/ folder as model.path"),
    ] = "rl"
    total_steps: Annotated[int, _f("training steps to run: batches, each of train.minibatches x epochs optimizer steps", ge=1)] = 60
    prompts_per_step: Annotated[int, _f("prompt groups per training step (batch = this * group_size)", ge=1)] = 8
    max_lag: Annotated[int, _f("max policy versions a trained sample may lag (0 = synchronous on-policy)", ge=0)] = 1
    sync_every: Annotated[int, _f("training steps (batches) between weight syncs to the generators", ge=1)] = 1
    mismatch_probe_samples: Annotated[
        int, _f("after each sync, samples scored by learner and vLLM to measure their log-prob mismatch", ge=0)
    ] = 8
    seed: Annotated[int, _f("seed of the learner")] = 0
    deterministic: Annotated[
        bool,
        _f("repeat the run: the same config and seeds give the same per-step values in metrics.jsonl and the same "
           "checkpoint parameters (timings and throughput aside). Each step's prompts are generated with policy "
           "version step - max_lag, every request has a seed of its own (generators.seed, prompt), a batch holds "
           "its groups in prompt order, and a weight sync waits until the engines generated everything admitted "
           "at their version (docs/determinism.md). Refuses what cannot repeat (an autoscaled pool, dynamic "
           "sampling, bf16 engines on cpu, agent and verifiers episodes, reward and teacher models)"),
    ] = False
    checkpoint_every: Annotated[
        int, _f("write RUN_DIR/checkpoints/step_N every this many steps (0 = only at the end, if checkpoint_at_end)", ge=0)
    ] = 0
    checkpoint_at_end: Annotated[bool, _f("write a checkpoint after the last step")] = True
    step_timeout_s: Annotated[
        float, _f("ceiling of a learner step's time limit: a step still running after min(this, max(120 s, 5 x the "
                  "slowest of the last 20 steps)) is a hang (a rank stuck in a collective), named in one line and "
                  "handled like a rank's death (train.recover) (0 = no limit)", ge=0)
    ] = 1800.0
    checkpoint_keep: Annotated[int, _f("checkpoints kept in RUN_DIR/checkpoints (the oldest are removed)", ge=1)] = 2
    recover: Annotated[
        Literal["auto", "off"],
        _f("what a learner rank's death or hang does: auto = the learner group restarts on fresh actors from the "
           "last checkpoint (from the initial weights at step 0 if none was written yet) and the run goes on; "
           "off = the run stops with one line naming the checkpoint to resume from"),
    ] = "auto"
    max_recoveries: Annotated[
        int, _f("learner recoveries allowed within train.recovery_window_steps; one more stops the run with one "
                "line, exit code 1", ge=0)
    ] = 3
    recovery_window_steps: Annotated[
        int, _f("training steps over which train.max_recoveries is counted (0 = the whole run)", ge=0)
    ] = 100
    minibatches: Annotated[
        int,
        _f("optimizer steps per batch: each learner rank's shard is cut into this many mini-batches of whole groups "
           "(in order, the same cut every epoch; at most prompts_per_step / data-parallel ranks). Advantages, the "
           "old and proximal log-probs and ppo's one critic step are computed once per batch, before its first "
           "update. The policy version, the LR schedule, total_steps, max_lag and sync_every still count batches: "
           "one version per batch however many updates it takes", ge=1),
    ] = 1
    epochs: Annotated[
        int, _f("passes over the batch's mini-batches: minibatches x epochs optimizer steps per batch", ge=1)
    ] = 1
    max_nonfinite_steps: Annotated[
        int,
        _f("a non-finite loss or gradient norm skips that optimizer step (weights and optimizer state kept; "
           "counted as nonfinite_steps); this many in a row stop the run (0 = never)", ge=0),
    ] = 3


class SftConfig(_Section):
    """train.mode=sft: supervised fine-tuning on chat demonstrations (docs/sft.md)."""

    train_files: Annotated[
        list[str], _f("demonstration files (.jsonl, .json or .parquet): one conversation per row in messages_key")
    ] = msgspec.field(default_factory=list)
    eval_files: Annotated[
        list[str], _f("held-out demonstration files: their loss (NLL per assistant token) is evaluated during training")
    ] = msgspec.field(default_factory=list)
    messages_key: Annotated[
        str, _f("column with the conversation: a list of chat messages {role, content}, at least one assistant turn")
    ] = "messages"
    batch_size: Annotated[int, _f("conversations per optimizer step, over all learner ranks", ge=1)] = 16
    max_length: Annotated[
        int, _f("conversations longer than this many tokens are cut (counted); 0 = generators.max_model_len", ge=0)
    ] = 0
    eval_every: Annotated[
        int, _f("evaluate the eval_files' loss after every this many steps (0 = at the start and the end only)", ge=0)
    ] = 0
    shuffle: Annotated[bool, _f("a new order of the conversations each epoch (seeded by train.seed)")] = True
