"""16-bit SSM states with stochastic rounding, reached from the engine: the seeds live on the device,
advance every step, and reach every op that stores a state (prefill scan, decode step, verify)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.rounding import StochasticRounding
from fastmamba.generation.sampling import SamplingParams
from tests.helpers import scaled_tiny_model

pytestmark = pytest.mark.kernels  # the kernels round stochastically; the references round to nearest

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]


@pytest.fixture(scope="module")
def model():
    # the kernels round stochastically (the references round to nearest): CUDA when present, else the
    # CPU under the interpreter
    return scaled_tiny_model("cuda" if torch.cuda.is_available() else "cpu")


def _long_params() -> SamplingParams:
    """Greedy, long enough not to finish within the test (and past any end-of-sequence token)."""
    if "ignore_eos" in SamplingParams.__dataclass_fields__:
        return SamplingParams(max_new_tokens=50, ignore_eos=True)
    return SamplingParams(max_new_tokens=50)


def _states(engine: Engine, decode_steps: int) -> list[torch.Tensor]:
    """Admit PROMPTS (one prefill step), run ``decode_steps`` decode steps, return the requests' SSM
    state rows of every layer (copies)."""
    rids = [engine.add_request(p, _long_params()) for p in PROMPTS]
    engine.step()
    for _ in range(decode_steps):
        engine.step()
    slots = [r.slot for r in engine.running]
    assert len(slots) == len(rids)
    return [ssm[slots].clone() for ssm in engine.cache.ssm]


def _engine(model, dtype, *, sr: bool, seed: int = 0) -> Engine:
    return Engine(model, max_batch=3, cuda_graphs=False, ssm_dtype=dtype, stochastic_rounding=sr, rounding_seed=seed)


def test_seed_changes_the_16bit_state_and_a_fixed_seed_reproduces_it(model):
    """fp16 through prefill and one decode step (bf16: the prefill test below)."""
    dtype = torch.float16
    a = _states(_engine(model, dtype, sr=True, seed=1), decode_steps=1)
    again = _states(_engine(model, dtype, sr=True, seed=1), decode_steps=1)
    other = _states(_engine(model, dtype, sr=True, seed=2), decode_steps=1)
    for x, y, z in zip(a, again, other):
        assert x.dtype == dtype
        assert torch.equal(x, y)  # the same seed, the same rounding
        assert not torch.equal(x, z)  # another seed rounds some elements the other way
        # the same states up to rounding
        torch.testing.assert_close(x.float(), z.float(), atol=5e-2, rtol=5e-2)


def _neighbours_ok(stored: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether each 16-bit element is one of the two representable neighbours of the fp32 value."""
    down = exact.to(stored.dtype)
    up = torch.nextafter(down, torch.where(exact > down.float(), torch.inf, -torch.inf).to(stored.dtype))
    s = stored.float()
    return bool(((s == down.float()) | (s == up.float())).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_scan_rounds_stochastically_between_the_neighbours_of_the_fp32_state(model, dtype):
    """After the prefill step alone: the fp32-state engine's state, rounded down or up element by
    element (never further), not always to nearest, and the seed picks which."""
    exact = _states(_engine(model, torch.float32, sr=False), decode_steps=0)
    s1 = _states(_engine(model, dtype, sr=True, seed=1), decode_steps=0)
    s2 = _states(_engine(model, dtype, sr=True, seed=2), decode_steps=0)
    for e, x, y in zip(exact, s1, s2):
        assert _neighbours_ok(x, e) and _neighbours_ok(y, e)
        assert not torch.equal(x, y)
        assert not torch.equal(x, e.to(dtype))  # not round to nearest


def test_stochastic_rounding_needs_a_16bit_state(model):
    with pytest.raises(ValueError, match="stochastic_rounding=True rounds 16-bit SSM states"):
        Engine(model, max_batch=1, cuda_graphs=False, ssm_dtype=torch.float32, stochastic_rounding=True)
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool"):
        Engine(model, max_batch=1, cuda_graphs=False, ssm_dtype=torch.float16, stochastic_rounding="yes")
    with pytest.raises(ValueError, match="seed must be an int"):
        Engine(model, max_batch=1, cuda_graphs=False, ssm_dtype=torch.float16, stochastic_rounding=True,
               rounding_seed=-1)


def test_seeds_advance_in_place_per_layer():
    r = StochasticRounding(3, "cpu", seed=5)
    ptr, first = r.seeds.data_ptr(), r.seeds.clone()
    assert first.tolist() == [(5 << 32) + i for i in range(3)]  # one seed per layer
    r.advance()
    assert r.seeds.data_ptr() == ptr  # in place: a captured graph reads the new seeds
    assert (r.seeds - first).tolist() == [3, 3, 3]
    with torch.inference_mode():
        r.advance()  # usable inside inference mode too
    assert (r.seeds - first).tolist() == [6, 6, 6]


def test_model_checks_rand_seed(model):
    cache = model.new_cache(1, ssm_dtype=torch.float16)
    slots = cache.alloc(1)
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"Mamba2LM.prefill_varlen: `rand_seed` expected an int64 tensor of shape \(2,\)"):
        model.prefill(ids, cache, slots, rand_seed=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="Mamba2LM.decode: `rand_seed`"):
        model.decode(ids[:, 0], cache, slots, rand_seed=3)


def test_verify_steps_pass_the_seed(model):
    """The verify step (plain path) stores 16-bit states with the seeds too (model level; from
    freshly allocated slots, which a speculative cache marks ready for verify)."""
    out = []
    for seed in (1, 1, 2):
        cache = model.new_cache(2, ssm_dtype=torch.float16, speculate=1)
        slots = cache.alloc(2)
        dev = model.lm_head.weight.device
        r = StochasticRounding(model.cfg.n_layer, dev, seed)
        model.verify(torch.tensor([[4], [7]], device=dev), cache, slots, path="plain", rand_seed=r.seeds)
        model.commit(cache, slots, torch.ones(2, dtype=torch.int32, device=dev), path="plain")
        r.advance()
        model.verify(torch.tensor([[9], [1]], device=dev), cache, slots, path="plain", rand_seed=r.seeds)
        out.append([s[slots.long()].clone() for s in cache.ssm])
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))
    assert not all(torch.equal(a, c) for a, c in zip(out[0], out[2]))
