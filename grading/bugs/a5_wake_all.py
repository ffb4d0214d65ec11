"""Assignment 5, seeded bug: the engine wakes everything (weights and KV cache) before the update: the old KV
cache, the weights and the trainer's exported buffer share the GPU at once, the peak that ``wake_up(tags=...)``
exists to avoid (an out-of-memory error at scale)."""

from labsupport import vllm_ext

LOSES = {"test_the_cycle_runs_in_order",
         "test_the_step_at_another_level_sends_the_trained_weights_in_the_engines_dtype"}


def colocated_step(llm, model, train, *, level=1):
    llm.sleep(level=level)
    train(model)
    llm.wake_up()  # the bug: every tag at once, before the update
    dtype = llm.llm_engine.model_config.dtype
    vllm_ext.push_ipc(llm, [(n, p.detach().to(dtype)) for n, p in model.named_parameters()])
    llm.reset_prefix_cache()
