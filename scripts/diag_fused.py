"""Throwaway GPU diagnosis of the fused scan (not committed)."""
import os, subprocess, sys, json
CASES = [
    dict(name="bf16_1x40_t16", dtype="bfloat16", lens=[40], bt=16),
    dict(name="bf16_1x512_t16", dtype="bfloat16", lens=[512], bt=16),
    dict(name="bf16_16x64_t16", dtype="bfloat16", lens=[64]*16, bt=16, bp=32),
    dict(name="bf16_1x40_t32", dtype="bfloat16", lens=[40], bt=32),
    dict(name="bf16_1x40_t64", dtype="bfloat16", lens=[40], bt=64),
    dict(name="fp32_1x40_t64", dtype="float32", lens=[40], bt=64),
    dict(name="bf16_1x40_t64_w8", dtype="bfloat16", lens=[40], bt=64, warps=8),
]
CHILD = r'''
import json, sys, torch
from fastmamba.ops.ssd_scan import ssd_scan_varlen
from fastmamba.ops.ssd_scan.ref import ssd_scan_varlen_ref
from fastmamba.ops.ssd_scan.fused_configs import forced_fused_config
c = json.loads(sys.argv[1]); dt_ = getattr(torch, c["dtype"]); dev="cuda"
H,P,G,N = 80,64,1,128; lens=c["lens"]; T=sum(lens)
g=torch.Generator().manual_seed(0)
x=torch.randn(T,H,P,generator=g).to(dev,dt_); dt=(torch.randn(T,H,generator=g)*0.5-1).to(dev,dt_)
A=-torch.rand(H,generator=g).add(0.5).to(dev); B=torch.randn(T,G,N,generator=g).to(dev,dt_); C=torch.randn(T,G,N,generator=g).to(dev,dt_)
kw=dict(chunk_size=256)
if c.get("z"): kw["z"]=torch.randn(T,H,P,generator=g).to(dev,dt_)
if c.get("D"): kw["D"]=torch.randn(H,generator=g).to(dev)
if c.get("bias"): kw["dt_bias"]=torch.randn(H,generator=g).to(dev)
n=len(lens); cu=torch.tensor([0]+torch.tensor(lens).cumsum(0).tolist(),dtype=torch.int32,device=dev)
states=torch.randn(n,H,P,N,generator=g).to(dev)
if c.get("init"): kw["has_initial_state"]=torch.ones(n,dtype=torch.bool,device=dev)
mine=states.clone()
ctx = forced_fused_config(block_t=c.get("bt",16), block_p=c.get("bp",16), num_warps=c.get("warps",4))
with ctx:
    out=ssd_scan_varlen(x,dt,A,B,C,mine,cu,fused=True,max_seqlen=max(lens),**kw)
torch.cuda.synchronize()
rs=states.clone()
ref=ssd_scan_varlen_ref(x.float(),dt.float(),A,B.float(),C.float(),rs,cu,**{k:(v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k,v in kw.items()})
chk=states.clone(); oc=ssd_scan_varlen(x,dt,A,B,C,chk,cu,fused=False,**kw)
e=lambda a,b:((a.float()-b.float()).norm()/b.float().norm()).item()
print(json.dumps(dict(out_vs_ref=e(out,ref), chunked_vs_ref=e(oc,ref), state_vs_ref=e(mine,rs), nan=bool(out.isnan().any()))))
'''
for c in CASES:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(c)], capture_output=True, text=True, env=env, timeout=120)
    tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else r.stderr.strip().splitlines()[-1][:200]
    print(c["name"], "rc", r.returncode, tail, flush=True)
