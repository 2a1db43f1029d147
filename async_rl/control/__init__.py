"""The control plane: the training loop (controller), the run's processes and the calls on them
(runtime, settings), deaths and recoveries (supervisor, death_watch, recovery, start_retry,
failure_watch), the pool's size (autoscale, scale, operator_requests), checkpoints and resume
(checkpoint, checkpoint_manifest, resume_config), the leftovers of a killed launch, and the run's
metrics. It starts and calls the data plane (serving, generator, buffer, learner, weight sync); nothing
below imports it."""
