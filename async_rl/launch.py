"""python -m async_rl.launch CONFIG [section.key=value ...] [--dry-run] [--describe] [--resume RUN_DIR]

Exit codes: 0 done, 1 runtime failure (one line naming it), 2 configuration error (one line
naming the key), 130 interrupted. Every process the run started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from async_rl import versions
from async_rl.cluster.devices import ClusterView, local_view, ray_view, resolve_devices
from async_rl.cluster.placement import PlacementPlan, plan_placement
from async_rl.config import Config, describe, load_config, reward_model_serving, to_dict, to_yaml
from async_rl.control.leftovers import marked, stop_orphans
from async_rl.control.resume_config import check_given, saved_config, saved_with_overrides, split_positionals
from async_rl.errors import ConfigError, RunError
from async_rl.learner.moe_settings import settings_error
from async_rl.models.tiny import model_is_vision, model_routing, resolve_model_path
from async_rl.tasks.registry import load_task
from async_rl.tasks.rewards import load_reward
from async_rl.vision_settings import images_error, vision_error


def weight_sync_line(cfg: Config) -> str:
    """The weight-sync backend the run uses (`auto` resolved), shown under the placement plan."""
    from async_rl.control.settings import resolve_backend

    chosen = resolve_backend(cfg)
    how = " (auto)" if cfg.weight_sync.backend == "auto" else ""
    return f"weight sync: {chosen}{how}, buckets of {cfg.weight_sync.bucket_mb} MB"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m async_rl.launch", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="YAML config file (omit with --describe)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, applied in order")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and placement plan (every process's node, bundle and GPUs), exit; "
        "with ray.address set it connects to that cluster to read its nodes (loads no model)",
    )
    ap.add_argument("--describe", action="store_true", help="print every config key with default and meaning")
    ap.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest intact checkpoint (same step and version numbering; a damaged "
        "one is set aside, said in one line) with the run's saved config (overrides apply on top); a CONFIG "
        "given too is compared with it key by key. RUN_DIR/checkpoints/FOLDER resumes from that checkpoint",
    )
    return ap.parse_intermixed_args(argv)  # flags before or after the overrides


def check_inputs(cfg: Config) -> None:
    """Fail before anything starts: model path and task must resolve, and the settings that depend on the
    model take it (ConfigError, exit 2)."""
    routing = model_routing(cfg.model.path, cfg.model.cache_dir)  # a folder must exist; a preset is built later
    if why := settings_error(cfg.learner, routing.num_experts if routing is not None else 0):
        raise ConfigError(why)  # an MoE (or dense) model's learner settings (learner/moe_settings.py)
    task = load_task(cfg.task.name)
    vision = model_is_vision(cfg.model.path, cfg.model.cache_dir)
    first = None if cfg.data.train_files else next(iter(task.prompts(cfg.task.seed)), None)
    if why := vision_error(cfg, vision) or images_error(cfg, vision, first is not None and bool(first.images)):
        raise ConfigError(why)
    load_reward(cfg.task)  # a bad task.reward or task.reward_pattern fails here, not in every reward worker
    from async_rl.control.settings import frame_limit

    # a buffer.max_frame_mb below one full-length group (with its routes): one line here, not rejected groups
    frame_limit(cfg, routing, vision)


def make_run_dir(cfg: Config) -> Path:
    name = cfg.logging.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.logging.run_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunError(f"logging.run_name: run directory '{run_dir}' already exists and is not empty")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


_RAY_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_SILENT": "true"}


def cluster_view(cfg: Config) -> ClusterView:
    """What the plan is made against: the Ray cluster at ray.address (connected here, and the run
    keeps the connection), or this machine for a local Ray (not started yet)."""
    if not cfg.ray.address:
        return local_view()
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, log_to_driver=cfg.ray.actor_logs, runtime_env={"env_vars": _RAY_ENV})
    return ray_view(cfg.ray.address)


def disconnect_ray() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def start_ray(cfg: Config, plan: PlacementPlan) -> None:
    import ray

    if ray.is_initialized():  # connected to ray.address while planning
        return
    engines = cfg.generators.num_engines
    if cfg.generators.autoscale.enabled:  # room for the largest pool the autoscaler may grow to
        engines = max(engines, cfg.generators.autoscale.max_engines)
    needed = engines * cfg.generators.cpus_per_engine
    needed += cfg.learner.world_size * cfg.learner.cpus_per_rank
    if serving := reward_model_serving(cfg.task):  # the reward model's replicas beside the pool
        needed += serving.replicas * serving.cpus_per_replica
    if cfg.teacher.model:  # the distillation teacher's replicas beside the pool
        needed += cfg.teacher.replicas * cfg.teacher.cpus_per_replica
    env = _RAY_ENV
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=cfg.ray.actor_logs, runtime_env={"env_vars": env})
        return
    ray.init(
        num_cpus=cfg.ray.num_cpus or max(needed, plan.num_cores),
        include_dashboard=False,
        log_to_driver=cfg.ray.actor_logs,
        logging_level=logging.WARNING,
        object_store_memory=200 << 20,  # Ray carries control messages only; bulk data never goes here
        runtime_env={"env_vars": env},
    )


def _run_dir(cfg: Config, resume_from: Path | None) -> Path:
    """A new run directory with its config, or the resumed checkpoint's (its later metrics trimmed)."""
    from async_rl.control import checkpoint
    from async_rl.control.metrics import EVAL_FILE

    if resume_from is None:
        run_dir = make_run_dir(cfg)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        return run_dir
    run_dir = resume_from.parent.parent  # RUN_DIR/checkpoints/step_N
    step = checkpoint.load_state(resume_from).step
    (run_dir / f"config.resume-{step}.yaml").write_text(to_yaml(cfg))
    dropped = checkpoint.trim_metrics(run_dir, step)
    checkpoint.trim_metrics(run_dir, step, EVAL_FILE)
    print(f"resuming from {resume_from} (step {step}); {dropped} later metrics record(s) dropped", flush=True)
    checkpoint.discard_partial(run_dir, "resume")  # nothing writes one before the run starts
    return run_dir


def run_sft(cfg: Config, plan: PlacementPlan, model_dir: Path, resume_from: Path | None = None) -> int:
    """train.mode=sft: the learner alone on chat demonstrations (sft/runner.py)."""
    import ray

    from async_rl.sft.runner import SftRun

    run_dir = _run_dir(cfg, resume_from)
    print(f"run directory: {run_dir}\nmodel: {model_dir}", flush=True)
    start_ray(cfg, plan)
    sft = SftRun(cfg, model_dir, run_dir, plan, resume_from)
    try:
        summary = sft.run()
        last_eval = f"; held-out loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else ""
        print(f"done: {summary.steps} sft steps, loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}{last_eval}; "
              f"checkpoints in {run_dir / 'checkpoints'} (model/ is an HF folder: use it as model.path)", flush=True)
        return 0
    finally:
        sft.shutdown()
        ray.shutdown()


def _raise_interrupt(signum, frame):  # SIGTERM -> the same clean shutdown as Ctrl-C
    raise KeyboardInterrupt


def run(cfg: Config, plan: PlacementPlan, resume_from: Path | None = None) -> int:
    from async_rl.data import check_train_data

    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    if cfg.train.mode == "sft":
        from async_rl.sft.data import check_demonstrations

        check_demonstrations(cfg.sft, model_dir, cfg.sft.max_length or cfg.generators.max_model_len)
        with marked():  # an SFT run's processes carry the launcher's mark too (leftovers.py)
            return run_sft(cfg, plan, model_dir, resume_from)
    loaded = check_train_data(cfg, model_dir)  # a bad data row fails here, before anything starts
    if cfg.teacher.model:  # a teacher with another tokenizer too (the runtime checks again, for its other callers)
        from async_rl.teacher.setup import check_tokenizers, teacher_dir

        check_tokenizers(model_dir, teacher_dir(cfg))
    run_dir = _run_dir(cfg, resume_from)
    print(f"run directory: {run_dir}", flush=True)
    print(f"model: {model_dir}", flush=True)
    launched = versions.record_launch(run_dir, resume_from)
    print(f"versions: {versions.summary(launched)} (in {run_dir / versions.RECORD})", flush=True)
    if warning := versions.vllm_untested_line(launched.vllm.rpartition(" ")[2]):
        print(warning, flush=True)
    if loaded is not None:
        skipped = f", {sum(loaded.skipped.values())} bad row(s) skipped {dict(loaded.skipped)}" if loaded.skipped else ""
        print(f"data: {len(loaded.prompts)} training prompts x {cfg.data.epochs} epoch(s){skipped}", flush=True)
    print(plan.render(), flush=True)
    print(weight_sync_line(cfg), flush=True)
    with marked():  # every process the run starts carries this launcher's mark (leftovers.py)
        return _run_marked(cfg, plan, run_dir, model_dir, resume_from)


def _run_marked(cfg: Config, plan: PlacementPlan, run_dir: Path, model_dir: Path, resume_from: Path | None) -> int:
    import ray

    from async_rl.control.controller import Controller
    from async_rl.control.metrics import MetricsSink

    start_ray(cfg, plan)
    controller = Controller(cfg, model_dir, run_dir, plan, resume_from)
    metrics = None
    try:
        print("starting buffer, generators (vLLM) and learner ...", flush=True)
        wandb_config = {**to_dict(cfg), "versions": versions.stack_versions()}
        metrics = MetricsSink(run_dir, cfg.logging.wandb, wandb_config, cfg.train.total_steps)
        summary = controller.run(metrics)
        if controller.resumed_checksum is not None:
            ck = controller.resumed_checksum
            print(
                f"resumed at step {controller.start_step}: learner and engines held the checkpoint's weights "
                f"(checksum total={ck.total!r} sum_sq={ck.sum_sq!r} count={ck.count})",
                flush=True,
            )
        acc = summary.buffer.accounts
        print(
            f"done: {summary.steps} steps, policy v{summary.final_version}; mean reward "
            f"{sum(summary.first_rewards) / len(summary.first_rewards):.3f} (first steps) -> "
            f"{sum(summary.last_rewards) / len(summary.last_rewards):.3f} (last steps); "
            f"samples trained {acc.trained}, dropped-stale {acc.dropped_stale}, filtered {acc.filtered}, "
            f"lost {acc.lost}; metrics in {run_dir / 'metrics.jsonl'}",
            flush=True,
        )
        return 0
    finally:
        controller.shutdown()
        if metrics is not None:
            metrics.close()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.describe:
        for key, default, desc in describe():
            print(f"{key:<38} {default:<22} {desc}")
        return 0
    config, overrides = split_positionals(args.config, args.overrides) if args.resume else (args.config, args.overrides)
    if config is None and not args.resume:
        print("error: a CONFIG file is required (or --describe, or --resume RUN_DIR)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # A run started in the background by a non-interactive shell inherits SIGINT ignored, so `kill -INT`
    # did nothing; Ctrl-C and `kill -INT` now both stop it cleanly wherever it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        resume_line = None
        if args.resume and config is None:  # the run's own config, overrides on top
            from async_rl.control.checkpoint import resume_run_dir

            # no checkpoint: that one line first, not a missing config.yaml
            cfg, resume_line = saved_with_overrides(resume_run_dir(Path(args.resume)), overrides)
        else:
            cfg = load_config(config, overrides)
        check_inputs(cfg)
        view = cluster_view(cfg)
        cfg = resolve_devices(cfg, view)  # generators.device / learner.device: auto -> cuda or cpu
        plan = plan_placement(cfg, view=view)  # a plan the cluster cannot hold: one line, exit 2
        resume_from = None
        if args.resume:
            from async_rl.control.checkpoint import choose, latest, resume_run_dir

            # no checkpoint, or none intact: one-line ConfigError, exit 2 (a dry run changes nothing: unchecked)
            resume_from = latest(Path(args.resume)) if args.dry_run else choose(Path(args.resume))
            if config is not None:  # a CONFIG beside --resume: what differs from the run's own, key by key
                saved_path = saved_config(resume_run_dir(Path(args.resume)))
                resume_line = check_given(saved_path, resolve_devices(load_config(saved_path), view), cfg)
            if resume_line:
                print(resume_line, flush=True)
        if args.dry_run:
            print(to_yaml(cfg), end="")
            print(plan.render())
            print(weight_sync_line(cfg))
            disconnect_ray()
            return 0
        if stopped := stop_orphans():  # what an earlier launch, killed, left on this machine
            print(stopped, flush=True)
        return run(cfg, plan, resume_from)
    except (ConfigError, RunError) as exc:
        disconnect_ray()
        # Raised inside a Ray actor, the error is a RayTaskError subclass whose text is the remote
        # traceback; the one line is its cause's.
        cause = getattr(exc, "cause", None)
        print(f"error: {cause if isinstance(cause, (ConfigError, RunError)) else exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: all processes stopped", file=sys.stderr)
        return 130
    except Exception as exc:
        cause = getattr(exc, "cause", None)  # a RunError raised inside a Ray actor
        if isinstance(cause, (RunError, ConfigError)):
            print(f"error: {cause}", file=sys.stderr)
            return cause.exit_code
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"async_rl-crash-{os.getpid()}.log"
        log.write_text(traceback.format_exc())
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        print(f"error: {type(exc).__name__}: {last} (traceback in {log})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
