"""The Megatron-core learner backend (`learner.backend: megatron`): `backend` (the `ModelBackend`),
`learner` (the policy under megatron's DDP, optimizer and schedules), `model` (GPTModel construction),
`convert` (HF <-> Megatron weights), `batch` (the collated shard) and `cpu` (the CPU/gloo patches).
Importing this package imports no megatron-core; each module imports it lazily where it needs it."""
