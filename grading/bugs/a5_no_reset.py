"""Assignment 5, seeded bug: the prefix cache is not reset after the update: prompts whose KV blocks were cached
under the old weights are continued from those blocks, a silent mix of old and new weights."""

from labsupport import vllm_ext

LOSES = {"test_cached_prompts_are_answered_with_the_new_weights",
         "test_the_cycle_runs_in_order",
         "test_the_step_at_another_level_sends_the_trained_weights_in_the_engines_dtype"}
# On a GPU the engine really sleeps, and vLLM's sleep (level >= 1) clears the prefix cache with the KV cache it
# drops: no block is left to reuse, so only the cycle's order shows the missing reset there.
PASSES_ON_GPU = {"test_cached_prompts_are_answered_with_the_new_weights"}


def colocated_step(llm, model, train, *, level=1):
    llm.sleep(level=level)
    train(model)
    llm.wake_up(tags=["weights"])
    dtype = llm.llm_engine.model_config.dtype
    vllm_ext.push_ipc(llm, [(n, p.detach().to(dtype)) for n, p in model.named_parameters()])
    llm.wake_up(tags=["kv_cache"])  # the bug: no llm.reset_prefix_cache()
