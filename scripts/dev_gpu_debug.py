"""Temporary GPU diagnostics (deleted after use): stochastic rounding through each layer of the
stack, and graphed vs eager decode with and without PDL on the scaled tiny model."""
import torch

import fastmamba
from fastmamba.generation.cuda_graphs import GraphedDecoder
from fastmamba.generation.engine import Engine
from fastmamba.generation.rounding import StochasticRounding
from fastmamba.ops import selective_state_update
from tests.helpers import scaled_tiny_model

dev = "cuda"
g = torch.Generator().manual_seed(0)
# 1. op level
S, B, H, P, N = 4, 2, 4, 16, 16
x = torch.randn(B, H, P, generator=g).to(dev)
dt = torch.randn(B, H, generator=g).to(dev) - 3
A_log = torch.randn(H, generator=g).to(dev)
Bm, Cm = (torch.randn(B, 1, N, generator=g).to(dev) for _ in range(2))
st0 = torch.randn(S, H, P, N, generator=g).to(dev).half()
outs = []
for seed in (1, 2):
    st = st0.clone()
    selective_state_update(st, x, dt, A_log, Bm, Cm, dt_softplus=True, state_batch_indices=torch.tensor([1, 3], dtype=torch.int32, device=dev),
                           A_is_log=True, rand_seed=torch.tensor([seed], dtype=torch.int64, device=dev))
    outs.append(st)
print("op level: seeds differ ->", not torch.equal(outs[0], outs[1]))
# 2. model level
m = scaled_tiny_model("cuda")
ids = torch.randint(0, 256, (2, 5), generator=g).to(dev)
res = []
for seed in (1, 2):
    cache = m.new_cache(2, ssm_dtype=torch.float16)
    slots = cache.alloc(2)
    r = StochasticRounding(m.cfg.n_layer, torch.device(dev), seed)
    m.prefill(ids[:, :4], cache, slots, rand_seed=r.seeds)
    pre = [s.clone() for s in cache.ssm]
    r.advance()
    m.decode(ids[:, 4], cache, slots, rand_seed=r.seeds)
    res.append((pre, [s.clone() for s in cache.ssm]))
print("model prefill: seeds differ ->", any(not torch.equal(a, b) for a, b in zip(res[0][0], res[1][0])))
print("model decode: seeds differ ->", any(not torch.equal(a, b) for a, b in zip(res[0][1], res[1][1])))
# 3. engine, graphs on / off
for graphs in (False, True):
    st = []
    for seed in (1, 2):
        e = Engine(m, max_batch=2, ssm_dtype=torch.float16, stochastic_rounding=True, rounding_seed=seed, cuda_graphs=graphs)
        e.add_request(ids[0, :4].tolist(), fastmamba.generation.sampling.SamplingParams(max_new_tokens=3))
        e.step(); e.step()
        st.append([s.clone() for s in e.cache.ssm])
    print(f"engine graphs={graphs}: seeds differ ->", any(not torch.equal(a, b) for a, b in zip(st[0], st[1])))
# 4. graphed vs eager decode, PDL on / off (no weight change)
for pdl in (False, True):
    gc, ec = m.new_cache(4), m.new_cache(4)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    d = GraphedDecoder(m, gc, max_batch=4, pdl=pdl)
    m.prefill(ids[:, :4], gc, slots); m.prefill(ids[:, :4], ec, slots)
    a = d.decode(ids[:, 4], slots).clone(); b = m.decode(ids[:, 4], ec, slots)
    print(f"graph pdl={pdl} vs eager: max abs diff {(a - b).abs().max().item():.3e}; ssm diff "
          f"{max((x - y).abs().max().item() for x, y in zip(gc.ssm, ec.ssm)):.3e}")
    from fastmamba.ops._common.pdl import programmatic_dependent_launch
    if pdl:
        ec2 = m.new_cache(4); m.prefill(ids[:, :4], ec2, slots)
        with programmatic_dependent_launch():
            c = m.decode(ids[:, 4], ec2, slots)
        print(f"  eager under PDL vs graph pdl: {(a - c).abs().max().item():.3e}")
