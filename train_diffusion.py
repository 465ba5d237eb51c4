"""RL post-training for diffusion models: the loop over a rollout manager and a trainer group.

    python3 train_diffusion.py --hf-checkpoint DIR --prompt-data prompts.jsonl --rollout-batch-size 8 ...

`python3 train_diffusion.py --help` lists every flag; `--dry-run` prints the resolved configuration and the
batch geometry without starting anything. docs/ explains the concepts.
"""

from __future__ import annotations

import logging
import time

PROCESS_START = time.perf_counter()  # perf/startup_time counts from here

from miles.config.arguments import check_user_paths, format_dry_run, parse_args
from miles.config.preflight import ResumePoint
from miles.config.schedule import resolve_num_rollout
from miles.utils.errors import exit_on_user_error

logger = logging.getLogger("miles")


def train(args, resume: ResumePoint) -> None:
    # Heavy imports only after the command line is known to be good (a bad flag fails in a second).
    from miles.config.batch_geometry import batch_geometry
    from miles.config.schedule import run_schedule, should_save
    from miles.config.sections import RunConfig
    from miles.logging import lifecycle
    from miles.logging.ci_check import check_ci_metric
    from miles.logging.run_logger import RunLogger
    from miles.ray.colocation import ColocationPolicy
    from miles.ray.placement import create_placement_groups, init_ray
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.train_actor import TrainActorGroup

    config = RunConfig.from_args(args)  # the typed sections, built once; every part below reads them
    ray_began = time.perf_counter()
    init_ray(config)
    run_logger = RunLogger(config, started_at=PROCESS_START)
    run_logger.record_startup("launch", ray_began - PROCESS_START)  # imports, flags, preflight checks
    run_logger.record_startup("ray", time.perf_counter() - ray_began)
    try:  # the pictures and curves are written however the run ends (an error, Ctrl-C): see RunLogger.finish
        with run_logger.startup_part("actors"):
            placement = create_placement_groups(config)
            rollout_manager = RolloutManager(config, placement, run_logger)
            actor = None
            if not config.debug.debug_rollout_only:
                slots = placement.train
                actor = TrainActorGroup(config, slots.placement_group, gpu_share=slots.gpu_share or None,
                                        cpu_share=slots.cpu_share)

        # Engines load while the trainer does (they only need the trainer's weights at the first sync below).
        with run_logger.startup_part("engines_launch"):
            rollout_manager.launch_engines()
        start_rollout_id = 0
        if actor is not None:
            with run_logger.startup_part("trainer_init"):
                start_rollout_id = actor.init()
            run_logger.record_startup_laps("trainer_init", actor.init_laps)
            rollout_manager.load_state_dict((actor.loaded_extra_state or {}).get("data_source"))
        if config.data.start_rollout_id is not None:
            start_rollout_id = config.data.start_rollout_id
        schedule = run_schedule(args, start_rollout_id)
        run_logger.resume_history(start_rollout_id)  # the curves and grids cover the rollouts before the resume too
        if start_rollout_id and resume.checkpoint_dir:
            logger.info(lifecycle.resumed_line(resume.checkpoint_dir, start_rollout_id, config.data.num_rollout))
        with run_logger.startup_part("engines_ready"):  # what loading the engines takes beyond the trainer
            rollout_manager.wait_for_engines()
        logger.info(lifecycle.started_line(
            config.model.diffusion_model_family_resolved, config.model.hf_checkpoint, placement.device,
            config.placement.train_world_size if actor is not None else 0, placement.num_engines,
            config.placement.colocate, batch_geometry(args), schedule, config.logging.output_dir,
            trainer_on_host=config.trainer.on_host))
        if actor is not None and rollout_manager.has_engines:
            # The engines start from the trainer's weights (LoRA-initialised or loaded from --load).
            with run_logger.startup_part("weight_sync"):
                rollout_manager.survive_engine_death("the weight sync", lambda: actor.update_weights(
                    rollout_manager.engine_urls(), weight_version=start_rollout_id))
            # A restarted engine gets the current weights before it rejoins the router.
            rollout_manager.watch_engines(lambda url: actor.update_weights([url], rollout_manager.weight_version))
        rollout_manager.weight_version = start_rollout_id
        # Colocated: trainer and engines take turns on the GPUs while they must (see miles/ray/colocation.py).
        # A trainer on the host (--rollout-gradient-trainer host) holds no GPU memory: nothing to take turns on.
        trainer_on_gpus = actor is not None and not config.trainer.on_host
        turns = ColocationPolicy(
            config.placement.colocate_offload_policy,
            offload_train=config.placement.offload_train and trainer_on_gpus,
            offload_rollout=config.placement.offload_rollout and rollout_manager.has_engines and trainer_on_gpus,
            margin_gb=config.placement.colocate_memory_margin_gb,
        )
        if turns.trainer_offloads:
            with run_logger.startup_part("trainer_offload"):
                actor.offload()  # the engines generate first

        last_checkpoint = None
        for rollout_id in range(start_rollout_id, config.data.num_rollout):
            run_logger.begin_iteration()
            if rollout_manager.should_eval(rollout_id):
                with run_logger.phase("eval"):
                    rollout_manager.eval(rollout_id)

            with run_logger.phase("rollout"):
                samples = rollout_manager.generate(rollout_id)
            if rollout_id + 1 < config.data.num_rollout:
                if config.placement.overlap_rollout:
                    rollout_manager.generate_ahead(rollout_id + 1)  # on the current weights, while this one trains
                elif config.placement.rollout_prefetch == "on":  # encoded now, denoised on the weights trained next
                    rollout_manager.generate_ahead(rollout_id + 1, after_weight_version=rollout_id + 1)
            if actor is None:
                run_logger.flush(rollout_id)
                continue

            if turns.engines_release:
                with run_logger.phase("release"):
                    rollout_manager.release_memory()
            if turns.trainer_offloads:
                with run_logger.phase("onload"):
                    actor.onload()
            with run_logger.phase("train"):  # --diffusion-rollout-gradient: on the engines' gradient, no replay
                train_metrics = actor.train(rollout_id, samples, rollout_manager.policy_gradient_ask(samples))
            run_logger.log(rollout_id, train_metrics)

            if should_save(config, rollout_id):
                with run_logger.phase("save"):
                    last_checkpoint = actor.save(rollout_id, extra_state={"data_source": rollout_manager.state_dict()})
                logger.info(lifecycle.saved_line(rollout_id, last_checkpoint))
            exported = actor.export_if_due(rollout_id, run_logger.phase)  # --export-interval: <output-dir>/export/
            if exported:
                logger.info(lifecycle.exported_line(rollout_id, exported))

            if rollout_manager.has_engines:
                if config.placement.overlap_rollout:
                    with run_logger.phase("overlap_wait"):
                        rollout_manager.wait_ahead()  # the engines finish it before their weights change
                if turns.engines_release:
                    with run_logger.phase("resume"):
                        if turns.trainer_empties_cache:
                            actor.empty_cache()  # its training activations' cache: the engines generate beside it
                        rollout_manager.resume_memory()
                with run_logger.phase("weight_sync"):  # an engine that died while the trainer trained is found here
                    rollout_manager.survive_engine_death("the weight sync", lambda: actor.update_weights(
                        rollout_manager.engine_urls(), weight_version=rollout_id + 1))
                run_logger.log(rollout_id, actor.weight_sync_metrics)  # weight_sync/*: transports, bytes, checks
                rollout_manager.weight_version = rollout_id + 1
            if not turns.decided:
                with run_logger.phase("offload"):  # measured once: the trainer at rest, the engines resumed
                    actor.empty_cache()
                    turns.decide(actor.memory_stats(), rollout_manager.engine_memory())
                    actor.park_optimizer_state(turns.trainer_parks)  # where that keeps both sides resident
            if turns.trainer_offloads:
                with run_logger.phase("offload"):
                    actor.offload()
            run_logger.flush(rollout_id)

        if rollout_manager.should_eval(config.data.num_rollout, final=True):
            rollout_manager.eval(config.data.num_rollout)
            run_logger.flush(config.data.num_rollout)
        rollout_manager.shutdown()
    finally:
        run_logger.finish()
    logger.info(lifecycle.finished_line(run_logger.history, schedule, PROCESS_START, config.logging.output_dir,
                                        last_checkpoint))
    check_ci_metric(config.logging, run_logger.history)  # --ci-test: the run fails here when its metric missed the bar


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    resume = check_user_paths(args)
    length_rule = resolve_num_rollout(args)  # --num-rollout, or --num-epoch passes over the prompt data
    if args.dry_run:
        print(format_dry_run(args, length_rule, resume.start_rollout_id))
        return
    if resume.checkpoint_dir and resume.start_rollout_id >= args.num_rollout:  # a finished run asked to continue
        from miles.logging.lifecycle import nothing_to_train_line

        print(nothing_to_train_line(args.load, resume.checkpoint_dir, resume.start_rollout_id, args.num_rollout))
        return
    from miles.ray.shutdown import begin_run, stop_run

    begin_run()  # SIGINT/SIGTERM become an exception, so the finally below runs
    try:
        train(args, resume)
    finally:
        stop_run()  # engines, router, workers, shared memory: nothing outlives the run, however it ended


if __name__ == "__main__":
    main()
