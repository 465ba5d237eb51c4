"""What parking AdamW's moments on the host costs on this machine, in one table.

The full fine-tune at SD3.5-Medium size on one 80 GB GPU parks its two fp32 moments (16.7 GiB) in host memory through
each window's forwards and backwards (miles/backends/fsdp_utils/optimizer_parking.py). This measures, for state
tensors shaped like that model's (about a thousand of them), the first parking (pinned host memory allocated then),
the steady one, each direction's bandwidth, and one contiguous copy of the same bytes as the floor.

    python bench/bench_optimizer_parking.py --device cuda [--gib 16.7] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def sd35_medium_like_shapes(hidden: int = 1536, blocks: int = 24) -> list[tuple[int, ...]]:
    """Parameter shapes of an MMDiT with `blocks` joint blocks of width `hidden` (weights and biases)."""
    shapes = []
    for _ in range(blocks):
        for _stream in range(2):  # image and text streams
            shapes += [(6 * hidden, hidden), (6 * hidden,)]  # adaptive norm modulation
            shapes += [(hidden, hidden), (hidden,)] * 4  # q, k, v, out
            shapes += [(4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]  # feed-forward
            shapes += [(64,)] * 2  # q/k norms
    return shapes


def make_state(gib: float, device: torch.device) -> list[torch.Tensor]:
    shapes = sd35_medium_like_shapes()
    per_set = sum(torch.Size(s).numel() for s in shapes) * 4
    sets = max(1, round(gib * (1 << 30) / per_set))
    return [torch.zeros(s, device=device) for _ in range(sets) for s in shapes]


def timed(device: torch.device, work) -> float:
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gib", type=float, default=16.7, help="bytes of optimizer state to park")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    device = torch.device(opts.device)
    state = make_state(opts.gib, device)
    nbytes = sum(t.numel() * t.element_size() for t in state)
    gib = nbytes / (1 << 30)
    print(f"{torch.cuda.get_device_name(device)}: {len(state)} state tensors, {gib:.2f} GiB", flush=True)
    rows = []

    # 1. `.to("cpu", non_blocking=True)` and back: PyTorch's pinned-memory cache (the colocation turns' moves)
    holder = list(state)

    def to_host():
        for i, t in enumerate(holder):
            holder[i] = t.to("cpu", non_blocking=True)

    def to_device():
        for i, t in enumerate(holder):
            holder[i] = t.to(device, non_blocking=True)

    rows.append(("tensor.to, first park (pinned cache fills)", timed(device, to_host)))
    rows.append(("tensor.to, first unpark", timed(device, to_device)))
    for r in range(opts.repeats):
        rows.append((f"tensor.to, park {r + 2}", timed(device, to_host)))
        rows.append((f"tensor.to, unpark {r + 2}", timed(device, to_device)))

    torch._C._host_emptyCache()  # give the pinned cache back before the next allocation

    # 2. pinned buffers allocated once, then copied into and out of (miles/utils/pinned.py)
    started = time.perf_counter()
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in holder]
    rows.append(("pinned buffers allocated (once)", time.perf_counter() - started))

    def park():
        for i, (t, b) in enumerate(zip(holder, buffers)):
            b.copy_(t, non_blocking=True)
            holder[i] = b

    def unpark():
        for i, b in enumerate(buffers):
            holder[i] = b.to(device, non_blocking=True)

    for r in range(opts.repeats):
        rows.append((f"persistent buffers, park {r + 1}", timed(device, park)))
        rows.append((f"persistent buffers, unpark {r + 1}", timed(device, unpark)))

    del buffers
    # 3. the floor: one contiguous copy of the same bytes each way
    flat_device = torch.empty(nbytes // 4, device=device)
    flat_host = torch.empty(nbytes // 4, pin_memory=True)
    rows.append(("one contiguous copy, device to host",
                 timed(device, lambda: flat_host.copy_(flat_device, non_blocking=True))))
    rows.append(("one contiguous copy, host to device",
                 timed(device, lambda: flat_device.copy_(flat_host, non_blocking=True))))

    print("| what | s | GB/s |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
