"""Tensor parallelism of the Nemotron-3 MoE hybrids on CPUs (gloo, 2 ranks): each rank holds its
share of every routed expert's channels and of the shared expert's, the router whole; one
all-reduce per MoE layer. Logits equal TP=1 (fp32, relative error <= 1e-5) with and without a
latent projection and biases; greedy tokens from a save_pretrained checkpoint (per-expert tensors,
each rank reading its slices) and from a preset with an MTP layer (left out of a rank's model)
equal TP=1's; the sizes that cannot be split are refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmamba.distributed import TPGroup
from fastmamba.distributed.nemotron_h import check_tp_nemotron_h, nemotron_h_shard_plan
from fastmamba.distributed.shard import slice_tensor
from fastmamba.models.nemotron_h import PRESETS
from tests.distributed._cases import assert_rank_shapes_are_its_slices, moe_model

TINY = PRESETS["nemotron-3-tiny"]
LATENT = dataclasses.replace(TINY, moe_latent_size=24, mlp_bias=True, n_routed_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=False)
PROMPTS = [[5, 17, 60, 3, 44], [9, 2], [70, 71, 72, 10, 11, 12, 1]]
MAX_NEW = 5


def save_moe_checkpoint(path) -> str:
    """A NemotronHForCausalLM with MoE layers (pattern M*E-ME, 8 experts top-2, a shared expert),
    written by transformers' save_pretrained (routed experts stored one by one)."""
    transformers = pytest.importorskip("transformers")
    from tests.distributed._checkpoints import _randomise

    torch.manual_seed(4)
    cfg = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, hybrid_override_pattern="M*E-ME", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=80, mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    _randomise(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith(("experts.up_proj", "experts.down_proj")):
                p.copy_(torch.randn_like(p) * 0.15)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tp2_moe(tmp_path_factory):
    """One spawn of 2 gloo ranks for every check below, and the TP=1 references."""
    import fastmamba
    from fastmamba.distributed import spawn_tp
    from tests.distributed._workers import greedy, run_nemotron_h, tp_moe

    ckpt = save_moe_checkpoint(tmp_path_factory.mktemp("tp_moe") / "ckpt")
    models = [moe_model(TINY, 5), moe_model(LATENT, 6)]
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, TINY.vocab_size, (2, 7), generator=g)
    steps = torch.randint(0, TINY.vocab_size, (2, 3), generator=g)
    refs = {"logits": [run_nemotron_h(m, prompts, steps) for m in models],
            "dir_greedy": greedy(fastmamba.load_model(ckpt, device="cpu"), PROMPTS, MAX_NEW),
            "mtp_greedy": greedy(fastmamba.load_model("nemotron-3-tiny-mtp", device="cpu"), PROMPTS, MAX_NEW)}
    cases = [(m.cfg, {k: v.clone() for k, v in m.state_dict().items()}) for m in models]
    results = spawn_tp(tp_moe, 2, cases, prompts, steps, ckpt, PROMPTS, MAX_NEW, device="cpu", timeout_s=300)
    return refs, results


def test_tp2_moe_logits_equal_tp1(tp2_moe):
    refs, results = tp2_moe
    for res in results:
        for c, (ref, got) in enumerate(zip(refs["logits"], res["logits"])):
            assert len(got) == len(ref) == 4
            for j, (want, have) in enumerate(zip(ref, got)):
                err = ((have - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"rank {res['rank']}, case {c}, call {j}: relative error {err:.2e}"


def test_tp2_moe_checkpoint_dir_reads_slices_and_equals_tp1(tp2_moe):
    refs, results = tp2_moe
    for res in results:
        assert res["reduced"] == [True, True]  # both MoE layers sum the ranks' partial outputs
        assert res["dir_greedy"] == refs["dir_greedy"], f"rank {res['rank']}"
        read, whole = res["dir_bytes"]
        assert read < 0.75 * whole, (read, whole)  # the experts' halves, not every expert whole


def test_tp2_preset_with_mtp_layer_runs_without_it(tp2_moe):
    refs, results = tp2_moe
    for res in results:
        assert res["mtp_dropped"]
        assert res["mtp_greedy"] == refs["mtp_greedy"], f"rank {res['rank']}"


def test_moe_plan_slices_and_local_shapes():
    """Rank 1 of 2 of the latent case: its expert channels are the second half, the router and the
    latent projections whole, the output biases zeros; the local model's shapes equal its slices."""
    plan = nemotron_h_shard_plan(LATENT, 1, 2)
    e = LATENT.pattern.index("E")
    m = f"backbone.layers.{e}.mixer."
    half = LATENT.moe_intermediate_size // 2
    assert plan[m + "experts.up_proj"].dim == 1 and plan[m + "experts.up_proj"].ranges == ((half, 2 * half),)
    assert plan[m + "experts.down_proj"].dim == 2
    assert plan[m + "gate.weight"] is None and plan[m + "fc1_latent_proj.weight"] is None
    assert plan[m + "fc2_latent_proj.bias"].zeros and plan[m + "shared_experts.down_proj.bias"].zeros
    assert nemotron_h_shard_plan(LATENT, 0, 2)[m + "fc2_latent_proj.bias"] is None  # rank 0 adds it
    assert_rank_shapes_are_its_slices(LATENT, 1, 2)


@pytest.mark.parametrize("change, match", [
    (dict(moe_intermediate_size=33), r"moe_intermediate_size=33 expert channels over world size 2"),
    (dict(moe_shared_expert_intermediate_size=63), r"moe_shared_expert_intermediate_size=63"),
])
def test_moe_widths_that_cannot_be_split_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_tp_nemotron_h(dataclasses.replace(TINY, **change), 2)


def test_drafter_mtp_with_tp_is_one_line_before_loading(capfd):
    from fastmamba.cli import main

    assert main(["generate", "--model", "nemotron-3-tiny-mtp", "--prompt-ids", "1,2", "--device", "cpu", "--tp", "2",
                 "--speculate", "2", "--drafter", "mtp"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--drafter mtp with --tp 2: tensor parallelism does not shard the MTP layer" in err[0]


@pytest.mark.parametrize("form", ["per-expert", "fused-3d"])
def test_rank_reads_its_expert_slices_in_either_form(tmp_path, form):
    """Rank 1 of 2 (no process group needed to load) from a checkpoint whose experts come one by one
    (as save_pretrained writes them) or fused [E, F, M']: every tensor is its plan's slice of the
    whole model; per-expert tensors missing an expert are refused by name before anything is read."""
    import fastmamba
    from fastmamba.distributed import load_tp_model
    from tests.models.test_nemotron3_moe import fused, per_expert, rewrite

    src = tmp_path / "src"
    save_moe_checkpoint(src)
    path = tmp_path / form
    rewrite(src, path, per_expert if form == "per-expert" else fused)
    whole = fastmamba.load_model(str(path), device="cpu").state_dict()
    part = load_tp_model(str(path), TPGroup(rank=1, world_size=2, device=torch.device("cpu")))
    plan = part.tp_plan
    assert plan["backbone.layers.2.mixer.experts.down_proj"].dim == 2
    for name, t in part.state_dict().items():
        torch.testing.assert_close(t, slice_tensor(whole[name], plan[name]), rtol=0, atol=0, msg=name)
    if form == "per-expert":
        bad = tmp_path / "missing"
        rewrite(src, bad, per_expert, edit=lambda sd: sd.pop("backbone.layers.5.mixer.experts.3.up_proj.weight"))
        with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight: missing \(n_routed_experts=8\)"):
            load_tp_model(str(bad), TPGroup(rank=1, world_size=2, device=torch.device("cpu")))
