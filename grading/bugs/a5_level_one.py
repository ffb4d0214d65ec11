"""Assignment 5, seeded bug: the engine always sleeps at level 1, whatever ``level`` asks: at level 2 (the weights
are about to be replaced, so not even a CPU copy is kept) it still offloads them, costing host memory and time."""

from labsupport import vllm_ext

LOSES = {"test_the_step_at_another_level_sends_the_trained_weights_in_the_engines_dtype"}


def colocated_step(llm, model, train, *, level=1):
    llm.sleep(level=1)  # the bug: not level=level
    train(model)
    llm.wake_up(tags=["weights"])
    dtype = llm.llm_engine.model_config.dtype
    vllm_ext.push_ipc(llm, [(n, p.detach().to(dtype)) for n, p in model.named_parameters()])
    llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
