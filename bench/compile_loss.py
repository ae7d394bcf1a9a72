#!/usr/bin/env python
"""What the loss's graph break costs a compiled training step (vescale/_compile.py).

Under data parallelism vescale makes Dynamo graph-break at ``F.cross_entropy`` so that the
loss keeps the autograd node that says what it averaged over (the ranks then weigh by
their targets, as one device does). This times a torch.compile'd nanoGPT-style step
(forward, backward, SGD) with the loss in the graph (torch's own behaviour) and with
vescale's break, each in its own process (the break is process-wide), in turns:

    .venv/bin/python bench/compile_loss.py [--rounds 2] [--vocab 8192] [--device cpu]

Prints each run's median step time over ``--steps`` steps after the warm-up ones.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(mode: str, args) -> float:
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.models.gpt import GPT, GPTConfig

    if mode == "break":
        from vescale._compile import keep_losses_eager
        keep_losses_eager()
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=4, n_embd=args.width,
                    bias=False)
    model = torch.compile(GPT(cfg).to(args.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    times = []
    for _ in range(args.warmup + args.steps):
        if args.device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if args.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[args.warmup:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", choices=["graph", "break"], help=argparse.SUPPRESS)  # one run (a child)
    args = p.parse_args()
    if args.mode:
        print(f"{_one(args.mode, args):.1f}")
        return
    results: dict[str, list[float]] = {"graph": [], "break": []}
    for _ in range(args.rounds):
        for mode in results:
            out = subprocess.run([sys.executable, __file__, "--mode", mode] + sys.argv[1:], check=True,
                                 capture_output=True, text=True).stdout
            results[mode].append(float(out.strip().splitlines()[-1]))
    print(f"nanoGPT {args.layers} layers, width {args.width}, vocabulary {args.vocab}, batch {args.batch} x "
          f"{args.seq}, {args.device}: median ms per step over {args.steps} steps, per run")
    for mode, label in (("graph", "loss in the graph (torch)"), ("break", "loss eager (vescale's break)")):
        print(f"  {label:32s} {', '.join(f'{t:.1f}' for t in results[mode])}")
    print(f"  ratio of medians: {statistics.median(results['break']) / statistics.median(results['graph']):.3f}")


if __name__ == "__main__":
    main()
