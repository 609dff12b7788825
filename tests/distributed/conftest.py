"""Tensor-parallel tests run the ops' PyTorch references (``tests.helpers.runtime_reference_ops``);
the spawned ranks inherit TRITON_INTERPRET=0 from the test's environment, so no rank runs the
Triton interpreter."""
from tests.helpers import runtime_reference_ops  # noqa: F401  (an autouse fixture for this folder)


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tp2_run(tmp_path_factory):
    """One group of 2 gloo ranks, spawned once for every TP=2 check (spawning costs seconds): the
    Mamba2LM checks of ``tests.distributed._workers.tp_check`` on the shared scaled mamba2-tiny
    (from memory and from a 2-file checkpoint), and the Nemotron-H hybrid's logits for two shapes.
    Returns the per-rank results and the TP=1 references computed here."""
    from fastmamba.distributed import spawn_tp
    from fastmamba.models.nemotron_h import PRESETS
    from tests.distributed._cases import hybrid_model, inputs, reference, save, tp2_mamba_model
    from tests.distributed._workers import run_nemotron_h, tp_check

    with pytest.MonkeyPatch.context() as mp:  # the ranks inherit it: the ops' references, no interpreter
        mp.setenv("TRITON_INTERPRET", "0")
        model = tp2_mamba_model()
        prompts, steps, prompt_lists = inputs(model.cfg.vocab_size, 1)
        ref_logits, ref_greedy = reference(model, prompts, steps, prompt_lists, 6)
        ckpt = tmp_path_factory.mktemp("tp2") / "ckpt"
        save(ckpt, model, shards=2, state_spaces=False)
        tiny = PRESETS["nemotron-h-tiny"]
        import dataclasses

        hybrids = [hybrid_model(tiny, 1), hybrid_model(dataclasses.replace(tiny, n_kv_heads=1, n_groups=1), 2)]
        g = torch.Generator().manual_seed(3)
        h_prompts = torch.randint(0, tiny.vocab_size, (2, 7), generator=g)
        h_steps = torch.randint(0, tiny.vocab_size, (2, 3), generator=g)
        hybrid_refs = [run_nemotron_h(m, h_prompts, h_steps) for m in hybrids]
        hybrid = ([(m.cfg, {k: v.clone() for k, v in m.state_dict().items()}) for m in hybrids], h_prompts, h_steps)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        results = spawn_tp(tp_check, 2, model.cfg, sd, str(ckpt), prompts, steps, prompt_lists, 6, hybrid=hybrid,
                           device="cpu", timeout_s=300)
    return {"results": results, "cfg": model.cfg, "ref_logits": ref_logits, "ref_greedy": ref_greedy,
            "hybrids": hybrids, "hybrid_refs": hybrid_refs}
