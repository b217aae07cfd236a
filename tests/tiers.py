"""Test tiers, chosen by what each test protects (the root ``conftest.py`` applies them).

- ``dev``: the developer's loop, under 5 minutes on 2 cores (``python -m pytest -q -n 2 -m dev``).
  Every contract that is cheap to check, whole: the resolver and rules, the sharding plan, the
  error catalogue and every bad input, the command line's grammar, the import rules of the
  folders, the golden summaries of the compiled programs, the docstring examples, the guides'
  Python blocks. And one representative of each numerical promise: sharded losses equal one
  device's (shardkit's GPT and models written without it), transformers' logits from Hugging
  Face checkpoints, a checkpoint restored onto another layout, the pipeline, ring attention,
  ZeRO and accumulation exact, the report's formulas.
- ``slow``: subprocess runs of the command line, several processes, notebooks, benchmarks,
  exhaustive planner searches.
- the rest: the other forms and layouts of the same promises.

CI runs all three (``python -m pytest -q -n 2``).
"""

# Whole modules: contracts that are cheap to check.
DEV_MODULES = {
    "test_architecture.py",
    "test_bad_inputs.py",
    "test_errors.py",
    "test_error_sites.py",
    "test_cli_grammar.py",
    "test_golden.py",
    "test_annotations.py",
    "test_layout_rules.py",
    "test_hlo.py",
    "test_hf.py",
    "test_hf_mapping.py",
    "test_types.py",
    "test_fsdp_min_size.py",
    "test_input_gradients.py",
    "test_invariance.py",
    "test_model_state.py",
    "test_gpt_compute_forms.py",
    "test_step_parts.py",
    "test_plan_from_config.py",
    "test_tokenizer.py",
    "test_host_allocator.py",
    "test_kubernetes.py",
    "test_packed.py",
    "test_experts.py",
    "test_eval.py",
    "test_run_dir.py",
    "test_partitioned.py",
    "test_docs.py",
    "test_tiers.py",
}

# One representative of each numerical promise (and the refusals) from the larger modules.
DEV_TESTS = {
    "test_any_model.py": {
        "test_losses_and_parameters_equal_one_device",
        "test_mesh_axis_metadata_is_used_as_mesh_axes",
        "test_shardkit_names_are_never_read_as_mesh_axes",
        "test_dryrun_factory_errors",
    },
    "test_hf_families.py": {
        "test_one_device_and_two_sharded_layouts_give_transformers_logits",
        "test_both_spellings_of_a_config_read_to_the_same_model",
        "test_an_unknown_key_is_refused_by_name",
        "test_options_shardkit_cannot_compute_are_refused",
        "test_the_fixtures_are_what_transformers_wrote",
    },
    "test_hf_moe_families.py": {
        "test_logits_are_transformers_on_one_device_and_under_expert_and_tensor_layouts",
        "test_what_each_family_reads_is_the_reference_config",
        "test_what_shardkit_cannot_compute_is_refused_by_key",
        "test_the_multi_token_prediction_layer_is_refused_by_name_or_dropped_when_asked",
        "test_an_embedding_larger_than_vocab_size_names_both",
    },
    "test_report.py": {
        "test_data_parallel_report_matches_the_all_reduce_formula",
        "test_tensor_parallel_report_has_megatron_all_reduces_per_layer",
        "test_matmul_flops_count_every_layer_and_match_the_model_count",
    },
    "test_pipeline.py": {
        "test_schedule_bubble_is_the_textbook_fraction",
        "test_1f1b_holds_at_most_2p_minus_1_microbatches_whatever_m",
        "test_executor_matches_jax_grad",
        "test_layers_that_do_not_divide_into_stages_are_refused",
        "test_model_without_stages_is_refused",
    },
    "test_accumulation.py": {"test_reducing_once_equals_one_device_dropout_included"},
    "test_generate.py": {
        "test_the_cache_gives_the_tokens_of_one_forward_per_token",
        "test_sampling_draws_the_same_tokens_on_any_layout_and_the_seed_matters",
        "test_the_cache_is_split_by_the_generation_layout_and_its_bytes_reported",
        "test_a_decode_step_reads_each_layers_weights_and_cache_where_they_lie",
        "test_bad_requests_are_refused_by_name",
        "test_a_layout_that_cannot_split_the_kv_heads_is_refused",
    },
    "test_zero.py": {"test_zero_stages_train_as_one_device_does"},
    "test_lora.py": {
        "test_an_adapter_peft_saved_gives_peft_s_logits",
        "test_the_optimizer_holds_state_for_the_adapters_only_and_no_base_gradient_is_computed",
        "test_bad_settings_are_refused_by_name",
        "test_an_adapter_shardkit_cannot_honour_is_refused_by_name",
    },
    "test_packing.py": {
        "test_a_packed_row_has_the_loss_of_its_documents_one_by_one",
        "test_what_cannot_pack_is_refused_by_name",
    },
    "test_instructions.py": {
        "test_a_chat_is_rendered_by_the_checkpoint_s_template_and_scores_the_assistant_turns",
        "test_a_bad_row_is_refused_naming_it",
    },
    "test_zoo.py": {"test_a_users_experts_split_over_tensor_reduce_at_the_tokens_size"},
    "test_expert_parallel.py": {
        "test_the_expert_term_is_gshards_four_all_to_alls_of_the_routed_tokens",
        "test_the_bound_reduces_shared_gradients_over_every_row_axis_and_experts_over_the_rest",
        "test_a_placed_forward_pass_computes_what_was_traced",
        "test_the_gpt_moves_its_bound_under_an_expert_layout",
        "test_the_callable_dropless_is_each_token_through_its_top_k_experts",
        "test_the_callable_refuses_a_layer_that_cannot_route",
    },
    "test_checkpoint.py": {
        "test_restore_onto_another_layout_continues_exactly",
        "test_restore_a_checkpoint_of_another_model",
        "test_restore_a_corrupted_checkpoint",
    },
    "test_checkpoint_safety.py": {
        "test_a_flipped_byte_anywhere_is_detected_and_the_previous_step_restored",
        "test_a_disk_that_fills_up_gives_one_clear_error_and_keeps_the_earlier_checkpoints",
        "test_two_writers_in_one_directory",
    },
    "test_attention.py": {
        "test_blocked_attention_equals_every_score_formed_forward_and_backward",
        "test_bad_input_is_refused_with_the_fix",
        "test_ring_attention_with_every_mask_equals_one_device",
    },
    "test_sequence.py": {
        "test_ring_attention_is_exact",
        "test_sequence_that_does_not_divide_the_sequence_axis_is_refused",
    },
    "test_scale_features.py": {
        "test_microbatches_equal_the_whole_batch",
        "test_nonfinite_skip_leaves_the_state_as_it_was",
        "test_bf16_master_policy_keeps_bf16_params_and_fp32_master",
    },
    "test_plan.py": {"test_tensor_parallelism_never_spans_nodes", "test_candidates_respect_layers_sequence_and_nodes"},
    "test_distributed.py": {"test_detect_from_environments", "test_single_process_initialize_is_a_no_op"},
    "test_extrapolate.py": {"test_layouts_that_cannot_be_halved_are_refused_before_any_compile"},
}


def is_dev(path: str, name: str, slow: bool) -> bool:
    """Whether a test (``path`` relative to the repository, ``name`` without parameters) is in
    the developer's loop; a test marked slow never is."""
    if slow:
        return False
    if path.startswith("shardkit/"):  # the package's docstring examples
        return True
    module = path.rsplit("/", 1)[-1]
    return module in DEV_MODULES or name in DEV_TESTS.get(module, ())
