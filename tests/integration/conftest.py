"""Which integration tests the default suite runs.

Integration tests start real processes. The default suite (``./scripts/test``) keeps the ones
that take seconds (commands, bad input, the control plane's own processes) and one smoke test
of each main path; a test that trains real pipelines for tens of seconds on 2 cores is marked
``slow`` here and runs in CI (``-m "slow or not slow"``). One list, so what the default suite
covers is read in one place rather than from markers spread over the files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Modules whose every test trains real pipelines (10-60 s each on 2 cores).
TRAINING_MODULES = {
    "test_block_moves.py", "test_control_run.py", "test_faults.py", "test_launch.py",
                    "test_memory_scenario.py",
    "test_mesh.py", "test_mesh_fsdp.py", "test_migration_faults.py", "test_migration_transparency.py",
    "test_multihost.py", "test_multistage.py", "test_multistage_train.py", "test_nas.py",
                    "test_pipedream_trainer.py",
    "test_pipeline_equivalence.py", "test_soak.py", "test_stage_shapes.py", "test_tensor_manager_pipeline.py",
    "test_train_conventions.py", "test_deferred_batch_norm_pipeline.py", "test_wpipe.py",
}

# The tests that train, or start several runs, in otherwise quick modules.
TRAINING_TESTS = {
    "test_attach.py::test_one_line_with_planning_off_changes_nothing",
    "test_attach.py::test_hand_written_loop_gets_the_same_losses_with_moves_and_recompute",
    "test_attach.py::test_one_line_with_live_rebalancing_keeps_the_losses",
    "test_bad_input_commands.py::test_ctrl_c_is_reported_as_an_interruption_not_a_failure",
    "test_bad_input_commands.py::test_two_runs_cannot_share_a_checkpoint_directory",
    "test_checkpoint.py::test_resume_keeps_adamw_its_weight_decay_and_a_warmup_cosine_schedule_on_the_same_and_"
    "other_stages",
    "test_checkpoint.py::test_resume_two_stages_on_four_matches_the_single_process_reference",
    "test_checkpoint.py::test_resume_on_the_same_stages_equals_an_uninterrupted_run",
    "test_checkpoint.py::test_resume_problems_are_named_at_launch_in_one_line",
    "test_deep_stages.py::test_three_thousand_blocks_on_one_stage_train_with_vpipe",
    "test_control_run_key.py::test_a_store_reader_cannot_pass_the_control_planes_authentication",
    "test_control_squatter.py::test_with_a_squatter_on_every_inbox_the_planner_attaches_and_plans_are_applied",
    "test_measure.py::test_a_run_measures_every_step_of_every_rank",
    "test_move_hangs.py::test_under_torchrun_a_stopped_rank_ends_the_run_within_the_trainers_timeout",
    "test_move_hangs.py::test_a_stopped_rank_that_hosts_the_store_still_lets_the_other_exit",
    "test_planner_judge.py::test_a_run_whose_planner_slows_it_down_is_put_back_and_says_so",
    "test_uneven_devices.py::test_over_200_steady_steps_an_even_pipeline_stays_put_and_a_slow_rank_is_left_once",
    "test_run_outputs.py::test_a_second_training_run_on_the_same_outputs_is_refused_while_the_first_trains",
    "test_run_outputs.py::test_a_run_under_umask_000_makes_its_files_0600_and_directories_0700_and_writes_vpipe_log_"
    "file",
    "test_warm_start.py::test_a_forked_rank_ends_the_run_with_the_code_a_cold_one_would",
    "test_warm_start.py::test_modules_and_code_strings_start_warm_too",
    "test_warm_start.py::test_the_starter_ends_its_ranks_when_the_launcher_goes",
    "test_warm_start.py::test_launchers_share_a_listening_starter_and_one_that_goes_takes_only_its_own_ranks",
    "test_warm_start.py::test_a_shared_starter_that_is_not_there_is_said_and_the_run_starts_its_own",
}

# Kept in the default suite all the same: one smoke test per main path.
SMOKE = {
    # the one line on the tutorial trainer's 6,2 split: blocks move, the losses stay those without vpipe
    "test_stage_shapes.py::test_one_line_rebalances_the_trainer_and_keeps_its_losses[train_tutorial-2-6,2-1f1b]",
    # a stage killed mid-move ends every rank, naming it
    "test_migration_faults.py::test_target_dying_mid_move_stops_every_rank_naming_it",
}


# The longest modules (minutes each in CI), longest first. Run on every core (-n auto --dist loadfile
# --no-loadscope-reorder: one module per xdist worker, in collection order), these start first, so that the
# many short modules fill the end and the workers finish together instead of one running a long module alone.
LONGEST_FIRST = [
    "test_stage_shapes.py", "test_multistage_train.py", "test_multistage.py", "test_mesh.py",
                 "test_launch.py",
    "test_migration_transparency.py", "test_mesh_fsdp.py", "test_checkpoint.py",
                 "test_pipeline_equivalence.py",
    "test_nas.py", "test_attach.py", "test_bad_input_commands.py", "test_tensor_manager_pipeline.py",
    "test_faults.py", "test_multihost.py", "test_control_run.py", "test_block_moves.py",
                 "test_migration_faults.py",
]


def _longest_first(items: list[pytest.Item]) -> None:
    """Put the longest modules first (a stable sort: every other test keeps its place)."""
    missing = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).exists()]
    if missing:
        raise pytest.UsageError(f"tests/integration/conftest.py orders modules that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)) if item.path.parent.name == "integration"
               else len(rank))


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected: set[str] = set()
    for item in items:
        if item.path.parent.name != "integration":
            continue
        module = item.path.name
        key, base = f"{module}::{item.name}", f"{module}::{getattr(item, 'originalname', item.name)}"
        collected |= {module, key, base}
        if key in SMOKE:
            continue
        if module in TRAINING_MODULES or key in TRAINING_TESTS or base in TRAINING_TESTS:
            item.add_marker(pytest.mark.slow)
    # a renamed test must not silently leave these lists (and land in the default suite, or out of it)
    stale = sorted(name for name in TRAINING_TESTS | SMOKE if name.partition("::")[0] in collected
                   and name not in collected)
    if stale:
        raise pytest.UsageError(f"tests/integration/conftest.py names tests that do not exist: {stale}")
    _longest_first(items)
