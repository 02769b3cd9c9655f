"""Which tests are ``integration`` tests and which are ``slow`` (markers registered in pyproject.toml).

``tests/conftest.py`` marks the tests named here, so ``pytest -m "not slow"`` is a quick loop and
``pytest -m integration`` runs the end-to-end tests alone. A name stands for every parametrization of
that test function; ``tests/test_marked_tests.py`` checks that every name still names a test.

- integration: runs the ``lit-grpo`` command (in this process through ``lit_grpo.cli``, or as a program),
  or starts processes or a server of its own (training on two processes, a vLLM or fake server, a
  subprocess that imports or trains); the code sandbox's own processes do not count.
- slow: over about 10 s on CI's 2 CPU cores: a training run in another process or on two processes, or a task
  learned over many steps (CI's log lists the 25 slowest tests with their seconds: one that appears there
  belongs here).
"""

from __future__ import annotations

EVERY_TEST = "every test of the file"

# file (from the repository's root) -> the test functions of that kind, or EVERY_TEST
INTEGRATION: dict[str, str | tuple[str, ...]] = {
    "tests/algorithm/test_evaluation.py": (
        "test_validate_subcommand_evaluates_a_checkpoint",
    ),
    "tests/bench/test_bench_long_completions.py": (
        "test_both_trainers_and_the_floor_run_at_a_tiny_vocabulary",
    ),
    "tests/bench/test_bench_modules.py": EVERY_TEST,
    "tests/cli/test_cli.py": EVERY_TEST,
    "tests/cli/test_errors.py": EVERY_TEST,
    "tests/cli/test_newcomer_errors.py": (
        "test_a_data_file_that_is_not_utf8_names_the_file_byte_offset_and_encoding",
        "test_a_csv_file_the_reader_cannot_read_says_why",
        "test_a_data_path_that_does_not_exist_says_so",
        "test_a_data_file_of_blank_lines_says_it_has_no_rows",
        "test_a_negative_learning_rate_is_refused_before_the_model_loads_naming_where_it_was_given",
        "test_a_learning_rate_that_is_no_number_on_the_command_line_is_blamed_on_the_command_line",
        "test_a_negative_number_after_a_space_says_to_write_key_equals_value",
        "test_a_reward_named_like_a_function_of_a_file_in_the_working_directory_says_file_py_function",
        "test_a_reward_named_by_module_whose_file_is_in_the_working_directory_says_file_py_function",
        "test_a_reward_file_name_near_a_file_that_exists_says_did_you_mean",
        "test_a_reward_function_without_kwargs_is_refused_at_start_saying_to_add_kwargs",
        "test_a_key_written_twice_in_one_mapping_names_both_lines",
    ),
    "tests/cli/test_newcomer_runs.py": (
        "test_what_a_run_says_while_its_bar_is_shown_starts_on_a_line_of_its_own",
        "test_the_lora_recipe_learns_the_quickstart",
        "test_a_command_that_trains_nothing_imports_neither_torch_nor_lightning",
        "test_a_run_stopping_on_an_error_that_writes_its_checkpoint_keeps_its_directory",
    ),
    "tests/cli/test_prompts.py": (
        "test_training_validation_and_rewards_see_the_rendered_prompts",
        "test_plain_prompts_stay_raw_text_unless_conversational",
        "test_prompts_command_shows_truncation_and_special_tokens",
        "test_prompts_command_shows_the_tools_schemas_and_refuses_a_misspelt_tool",
        "test_prompts_command_shows_an_environments_tools",
        "test_chat_prompts_without_a_chat_template_are_refused_naming_the_setting",
        "test_gsm8k_recipe_prompt_asks_for_the_format_its_rewards_score",
    ),
    "tests/cli/test_python_api.py": (
        "test_the_python_path_gives_the_reward_series_of_the_cli",
        "test_a_model_object_under_fsdp2_on_two_processes",
        "test_importing_lit_grpo_stays_cheap_and_exports_the_modules",
        "test_the_example_script_learns",
    ),
    "tests/cli/test_trl_names.py": (
        "test_each_lit_grpo_key_of_the_table_exists",
    ),
    "tests/cli/test_user_runs.py": EVERY_TEST,
    "tests/cpu/test_allocator.py": (
        "test_freed_memory_is_reused_without_page_faults",
        "test_without_it_freed_memory_is_faulted_in_again",
        "test_opt_out_and_the_users_own_settings_win",
    ),
    "tests/cpu/test_attention.py": (
        "test_import_caps_onednn_primitive_cache_unless_the_user_set_it",
    ),
    "tests/cpu/test_cpu_threads.py": (
        "test_two_busy_processes_on_this_processs_two_cpus_leave_it_one_thread",
        "test_a_childs_cpu_time_counts_as_this_processs_own",
        "test_an_exited_childs_cpu_time_stays_this_processs_own",
        "test_lit_grpo_sets_the_wait_policy_before_torch_loads",
    ),
    "tests/plugins/test_example_plugin.py": EVERY_TEST,
    "tests/plugins/test_openenv_plugin.py": (
        "test_rollouts_reset_their_own_episode_and_step_through_the_tool",
        "test_a_few_training_steps_log_the_environment_s_reward",
        "test_lit_grpo_environments_lists_it",
    ),
    "tests/plugins/test_reasoning_gym_plugin.py": (
        "test_lit_grpo_environments_lists_the_data_set_with_its_package",
        "test_the_shipped_config_trains_on_a_mix",
    ),
    "tests/plugins/test_verifiers_plugin.py": (
        "test_lit_grpo_environments_lists_what_the_plugin_brings",
    ),
    "tests/rewards/test_numeric_accuracy.py": (
        "test_listed_by_lit_grpo_rewards",
    ),
    "tests/rewards/test_sandbox_attacks.py": (
        "test_signalling_the_trainer",
    ),
    "tests/rewards/test_sandbox_without_root.py": EVERY_TEST,
    "tests/rollout/test_async_learning.py": EVERY_TEST,
    "tests/rollout/test_async_rollouts.py": (
        "test_one_step_off_trains_each_batch_one_optimizer_step_after_it_was_sampled",
        "test_killed_one_step_off_run_resumes_with_no_prompt_lost_or_trained_twice",
        "test_batches_older_than_max_staleness_are_dropped_and_counted",
        "test_two_processes_keep_every_ranks_batches_in_flight_across_a_resume",
        "test_a_checkpoint_gathers_every_ranks_batches_in_flight_to_the_writer_only",
        "test_a_reward_that_raises_in_the_background_on_one_rank_stops_both_ranks_with_a_checkpoint",
        "test_signals_while_the_pipeline_fills_and_while_a_slow_reward_scores_checkpoint_at_once",
        "test_reward_errors_are_logged_at_the_step_that_trains_the_batch",
    ),
    "tests/rollout/test_async_tools.py": (
        "test_killed_one_step_off_dynamic_sampling_run_resumes_exactly",
        "test_killed_one_step_off_tools_run_resumes_with_no_prompt_lost_or_trained_twice",
    ),
    "tests/rollout/test_dynamic_sampling.py": (
        "test_dynamic_sampling_on_two_processes_keeps_ranks_in_step",
    ),
    "tests/rollout/test_multi_objective.py": (
        "test_two_ranks_advantages_use_the_whole_batch_as_trl",
    ),
    "tests/rollout/test_server_security.py": (
        "test_the_trainer_sends_the_key_on_every_request_and_a_refusal_names_the_variable",
    ),
    "tests/rollout/test_tools.py": (
        "test_hung_tools_neither_starve_the_next_calls_nor_keep_the_process_alive",
        "test_the_installed_environment_plugin_is_listed_with_its_package",
        "test_tools_quickstart_config_runs_through_the_cli_with_the_environment",
        "test_long_tool_results_are_cut_to_max_tool_result_length_in_a_real_run",
        "test_tool_results_that_would_pass_the_models_context_are_dropped_in_a_real_run",
        "test_two_processes_with_different_numbers_of_turns",
    ),
    "tests/rollout/test_vllm.py": EVERY_TEST,
    "tests/rollout/test_vllm_server.py": EVERY_TEST,
    "tests/run/test_checkpoint_safety.py": (
        "test_export_refuses_a_checkpoint_with_a_pickled_payload",
        "test_export_refuses_a_sharded_checkpoint_whose_metadata_or_meta_pt_holds_a_payload",
        "test_fit_refuses_a_crafted_checkpoint_a_remote_one_and_weights_only_false_in_one_line",
    ),
    "tests/run/test_completions.py": (
        "test_completions_command_shows_a_step",
        "test_completions_command_errors_name_what_is_missing",
    ),
    "tests/run/test_lora_export.py": (
        "test_exported_model_generates_the_trained_policys_tokens",
        "test_export_errors_name_the_problem",
        "test_cli_fit_with_lora_and_export_callback_then_export_adapter",
        "test_a_merged_export_of_an_adapted_tied_head_computes_what_the_trained_model_computes",
    ),
    "tests/run/test_preemption.py": (
        "test_signal_mid_step_checkpoints_the_step_reached_and_the_resume_is_exact",
        "test_two_processes_stop_after_the_same_step_when_only_rank_0_gets_sigterm",
        "test_under_slurm_lightnings_requeue_runs_after_the_checkpoint",
        "test_full_log_disk_mid_run_ends_with_one_error_line_and_the_earlier_checkpoint_loads",
        "test_checkpoint_write_on_a_full_disk_is_a_write_error_and_keeps_the_previous_one",
        "test_completions_on_a_full_disk_are_a_write_error_and_the_file_stays_readable",
        "test_logger_writes_on_a_full_disk_are_a_write_error_naming_the_logs",
    ),
    "tests/run/test_resume.py": (
        "test_sigkilled_run_resumed_with_ckpt_path_last_matches_uninterrupted_run",
        "test_sigkilled_multi_turn_tool_run_resumes_exactly",
        "test_rng_states_are_gathered_from_every_rank",
        "test_checkpoint_killed_while_being_written_leaves_the_previous_one_intact",
        "test_fit_checkpoints_last_ckpt_atomically_into_the_runs_directory",
        "test_configured_preemption_callbacks_are_kept",
        "test_configured_model_checkpoint_is_kept_and_gets_the_run_directory",
        "test_enable_checkpointing_false_adds_no_checkpoint",
        "test_a_one_process_checkpoint_resumed_on_two_processes_mid_epoch_stops_before_any_step",
    ),
    "tests/run/test_runs.py": EVERY_TEST,
    "tests/run/test_secrets.py": (
        "test_a_run_writes_no_planted_secret_and_resumes_and_exports_with_the_real_ones",
    ),
    "tests/scoring/test_function_rewards.py": (
        "test_a_file_beside_the_config_is_found_from_another_working_directory",
        "test_metrics_and_completions_name_function_rewards_by_function",
        "test_a_reward_that_raises_names_the_sample_its_own_frames_and_on_error",
        "test_rewards_command_lists_registered_plugins_only",
    ),
    "tests/scoring/test_scoring_parallel.py": (
        "test_a_worker_process_imports_no_torch",
        "test_worker_exception_with_raise_names_reward_sample_and_traceback",
        "test_one_step_off_quickstart_with_a_math_verify_reward_scores_as_in_the_main_thread",
    ),
    "tests/train/test_sequence_parallel.py": (
        "test_ulysses_forward_and_gradients_equal_the_padded_forward_and_a_failure_in_one_rank_ends_every_rank",
        "test_two_ranks_with_k_2_train_exactly_as_one_process_on_the_union_of_their_rows",
        "test_lit_grpo_fit_on_two_processes_with_sequence_parallel_size_2_logs_its_steps",
        "test_lit_grpo_fit_on_one_process_with_sequence_parallel_size_2_is_refused_in_one_line",
    ),
    "tests/train/test_distributed.py": (
        "test_two_processes_match_one_process",
        "test_rows_without_gradient_skipped_on_two_processes_match_one_process_training_every_row",
        "test_old_logps_pass_leaves_out_zero_advantage_rows_on_two_processes",
        "test_fsdp2_resume_from_sharded_checkpoint_continues_exactly",
        "test_fsdp2_generation_gathers_weights_once_and_ranks_finish_independently",
        "test_validation_metrics_reduce_over_ranks_like_one_process",
        "test_a_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message",
    ),
    "tests/train/test_cast_lm_head_at_start.py": (
        "test_fit_refuses_the_cast_with_a_lora_adapter_on_the_head_before_sampling",
    ),
    "tests/train/test_entropy_bonus.py": (
        "test_two_ranks_agree_on_the_adaptive_coefficient_of_one_process",
        "test_a_rank_failing_at_its_optimizer_step_ends_both_ranks_with_its_error",
    ),
    "tests/train/test_fused_head_logprobs.py": (
        "test_fsdp2_sharded_head_gives_the_full_logits_values",
    ),
    "tests/train/test_padding_free.py": (
        "test_fsdp2_packed_run_equals_the_padded_run",
    ),
    "tests/train/test_trl_loss_options.py": (
        "test_vespo_with_the_off_policy_mask_on_two_processes_matches_one_process",
    ),
    "tests/train/test_validation_ranks.py": (
        "test_an_evaluation_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message",
    ),
}

# from --durations on 2 CPU cores; a test near 10 s may fall on either side on another machine
SLOW: dict[str, str | tuple[str, ...]] = {
    "tests/bench/test_bench_gpu_check.py": (
        "test_gpu_check_reports_every_part_on_cpu",
        "test_padding_free_part_times_packed_and_padded_with_the_same_logprobs",
    ),
    "tests/bench/test_bench_long_completions.py": (
        "test_both_trainers_and_the_floor_run_at_a_tiny_vocabulary",
    ),
    "tests/cli/test_errors.py": (
        "test_a_user_error_is_one_line_and_status_2_and_a_traceback_on_request",
        "test_a_real_run_prints_no_unactionable_warnings_and_its_error_starts_a_fresh_line",
    ),
    "tests/cli/test_newcomer_runs.py": (
        "test_the_lora_recipe_learns_the_quickstart",
    ),
    "tests/cli/test_python_api.py": (
        "test_the_python_path_gives_the_reward_series_of_the_cli",
        "test_a_model_object_under_fsdp2_on_two_processes",
        "test_the_example_script_learns",
    ),
    "tests/cli/test_user_runs.py": (
        "test_two_process_fit_with_logger_completions_validation_and_checkpoints",
        "test_shipped_recipe_trains",
    ),
    "tests/cpu/test_allocator.py": (
        "test_opt_out_and_the_users_own_settings_win",
    ),
    "tests/rollout/test_async_learning.py": EVERY_TEST,
    "tests/rollout/test_async_rollouts.py": (
        "test_one_step_off_trains_each_batch_one_optimizer_step_after_it_was_sampled",
        "test_killed_one_step_off_run_resumes_with_no_prompt_lost_or_trained_twice",
        "test_batches_older_than_max_staleness_are_dropped_and_counted",
        "test_two_processes_keep_every_ranks_batches_in_flight_across_a_resume",
        "test_a_reward_that_raises_in_the_background_on_one_rank_stops_both_ranks_with_a_checkpoint",
        "test_signals_while_the_pipeline_fills_and_while_a_slow_reward_scores_checkpoint_at_once",
        "test_reward_errors_are_logged_at_the_step_that_trains_the_batch",
    ),
    "tests/rollout/test_async_tools.py": (
        "test_killed_one_step_off_dynamic_sampling_run_resumes_exactly",
        "test_killed_one_step_off_tools_run_resumes_with_no_prompt_lost_or_trained_twice",
        "test_a_verifiers_environment_trains_one_step_off",
    ),
    "tests/rollout/test_dynamic_sampling.py": (
        "test_dynamic_sampling_on_two_processes_keeps_ranks_in_step",
    ),
    "tests/rollout/test_multi_objective.py": (
        "test_two_ranks_advantages_use_the_whole_batch_as_trl",
    ),
    "tests/rollout/test_tools.py": (
        "test_tools_quickstart_config_runs_through_the_cli_with_the_environment",
        "test_long_tool_results_are_cut_to_max_tool_result_length_in_a_real_run",
        "test_tool_results_that_would_pass_the_models_context_are_dropped_in_a_real_run",
        "test_two_processes_with_different_numbers_of_turns",
    ),
    "tests/rollout/test_vllm.py": (
        "test_bfloat16_pushed_engine_equals_engine_loaded_from_disk",
        "test_multi_turn_tool_rollouts_with_vllm_equal_transformers_greedy",
        "test_long_tool_results_neither_crash_the_engine_nor_pass_its_max_model_len",
        "test_quickstart_learns_with_the_vllm_backend",
        "test_one_step_off_with_the_colocated_engine_trains_on_its_older_samples",
        "test_two_processes_each_with_its_own_engine",
    ),
    "tests/rollout/test_vllm_server.py": (
        "test_the_server_samples_what_the_colocated_engine_samples",
        "test_quickstart_learns_through_a_server",
        "test_two_processes_on_one_and_two_servers_and_a_server_killed_mid_run_resumes_exactly",
        "test_one_step_off_samples_on_the_server_while_the_trainer_trains",
        "test_one_step_off_run_whose_server_dies_while_sampling_in_the_background_resumes_with_every_prompt",
        "test_a_request_refused_on_one_rank_ends_every_rank_with_its_line",
    ),
    "tests/run/test_preemption.py": (
        "test_signal_mid_step_checkpoints_the_step_reached_and_the_resume_is_exact",
        "test_two_processes_stop_after_the_same_step_when_only_rank_0_gets_sigterm",
        "test_under_slurm_lightnings_requeue_runs_after_the_checkpoint",
        "test_full_log_disk_mid_run_ends_with_one_error_line_and_the_earlier_checkpoint_loads",
    ),
    "tests/run/test_resume.py": (
        "test_sigkilled_run_resumed_with_ckpt_path_last_matches_uninterrupted_run",
        "test_sigkilled_multi_turn_tool_run_resumes_exactly",
        "test_a_one_process_checkpoint_resumed_on_two_processes_mid_epoch_stops_before_any_step",
    ),
    "tests/train/test_sequence_parallel.py": (
        "test_ulysses_forward_and_gradients_equal_the_padded_forward_and_a_failure_in_one_rank_ends_every_rank",
        "test_two_ranks_with_k_2_train_exactly_as_one_process_on_the_union_of_their_rows",
        "test_lit_grpo_fit_on_two_processes_with_sequence_parallel_size_2_logs_its_steps",
        "test_lit_grpo_fit_on_one_process_with_sequence_parallel_size_2_is_refused_in_one_line",
    ),
    "tests/train/test_distributed.py": (
        "test_two_processes_match_one_process",
        "test_rows_without_gradient_skipped_on_two_processes_match_one_process_training_every_row",
        "test_old_logps_pass_leaves_out_zero_advantage_rows_on_two_processes",
        "test_fsdp2_resume_from_sharded_checkpoint_continues_exactly",
        "test_fsdp2_generation_gathers_weights_once_and_ranks_finish_independently",
        "test_validation_metrics_reduce_over_ranks_like_one_process",
        "test_a_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message",
    ),
    "tests/train/test_entropy_bonus.py": (
        "test_two_ranks_agree_on_the_adaptive_coefficient_of_one_process",
        "test_a_rank_failing_at_its_optimizer_step_ends_both_ranks_with_its_error",
    ),
    "tests/train/test_fused_head_logprobs.py": (
        "test_training_steps_are_the_same_with_the_fused_head",
        "test_fsdp2_sharded_head_gives_the_full_logits_values",
    ),
    "tests/train/test_module.py": (
        "test_seeded_quickstart_task_learns",
    ),
    "tests/train/test_padding_free.py": (
        "test_fsdp2_packed_run_equals_the_padded_run",
    ),
    "tests/train/test_trl_loss_options.py": (
        "test_vespo_with_the_off_policy_mask_on_two_processes_matches_one_process",
    ),
    "tests/train/test_validation_ranks.py": (
        "test_an_evaluation_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message",
    ),
}
