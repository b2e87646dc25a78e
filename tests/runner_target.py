"""A model's command line for triattn-run's tests: builds Boltz's own pairformer
(boltz-community's ``PairformerModule``, its blocks ``TriangleAttention``) where no caller can
reach it, runs it on a small pair and prints the pair's sum. Run as a module (-m), a script,
or a console script (`main`)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fake-predict")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--grad", action="store_true", help="leave gradients on")
    parser.add_argument("--exit", type=int, default=0, help="the exit status to return")
    args = parser.parse_args(argv)

    import torch
    from boltz.model.layers.pairformer import PairformerModule

    model = PairformerModule(token_s=8, token_z=16, num_blocks=args.layers, num_heads=2,
                             pairwise_head_width=4, pairwise_num_heads=4).eval()
    s, z = torch.randn(1, 6, 8), torch.randn(1, 6, 6, 16)
    with torch.set_grad_enabled(args.grad):
        _, z = model(s, z, torch.ones(1, 6), torch.ones(1, 6, 6))
    print(f"pair sum {float(z.detach().sum()):.3f}")
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
