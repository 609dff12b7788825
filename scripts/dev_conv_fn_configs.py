"""causal_conv1d_fn launch configs side by side, timed as the prefill bench times them (development aid; GPU).

    python scripts/dev_conv_fn_configs.py [channel-first|channel-last]   # default: both layouts

Per case (the bench's conv_fn shapes, W=4, silu, bf16): the default config and a few others,
median µs of CUDA-graph replays over rotating input sets, and % of the measured copy bandwidth.
"""
import sys

import torch

from fastmamba.bench.peak import l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.timing import TimingConfig, choose_n_sets, time_calls
from fastmamba.ops import causal_conv1d_fn
from fastmamba.ops.conv1d_fn import configs

dev = torch.device("cuda")
ROWS = [None, (16, 128, 1), (16, 128, 2), (12, 128, 2), (20, 128, 2), (24, 128, 2), (16, 256, 4), (32, 128, 4)]
COLS = [None, (512, 4, 4), (512, 4, 2), (512, 1, 1), (1024, 2, 2)]


def make(B, D, L, layout, n_sets):
    sets = []
    for i in range(n_sets):
        g = torch.Generator(device=dev).manual_seed(i)
        if layout == "channel-last":
            x = torch.randn(B, L, D, device=dev, generator=g).bfloat16().transpose(1, 2)
        else:
            x = torch.randn(B, D, L, device=dev, generator=g).bfloat16()
        w = torch.randn(D, 4, device=dev, generator=g).bfloat16()
        b = torch.randn(D, device=dev, generator=g).bfloat16()
        sets.append((x, w, b))
    return sets


def main():
    copy = measure_copy_bandwidth(dev)
    l2 = l2_cache_bytes(dev)
    print(f"{torch.cuda.get_device_name()}, copy {copy:.0f} GB/s")
    for B, L in ((8, 8192), (1, 2048)):
        for D in (5376, 10240):
            for layout in sys.argv[1:] or ("channel-first", "channel-last"):
                nbytes = 2 * B * D * L * 2
                n_sets = choose_n_sets(nbytes, l2)
                sets = make(B, D, L, layout, n_sets)
                cells = []
                for cfg in (ROWS if layout == "channel-last" else COLS):
                    configs._forced = None if cfg is None else configs.ConvFnConfig(*cfg)
                    t = time_calls(lambda i: (lambda: causal_conv1d_fn(*sets[i], activation="silu")), n_sets,
                                   device=dev, config=TimingConfig.prefill())
                    cells.append(f"{'default' if cfg is None else 'x'.join(map(str, cfg))} {t.median_us:.1f} "
                                 f"({nbytes / t.median_us / 1e3 / copy:.0%})")
                configs._forced = None
                print(f"{B}x{L} D{D} {layout}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
