"""Rank 0 fetches a rollout's policy gradient from the engines (`--diffusion-rollout-gradient`).

The driver hands the trainer a `PolicyGradientAsk`: per engine, the coefficients c_b = −clip(A_b)/P of the samples
it served. Rank 0 asks each engine for its Σ_b c_b·G_b (`POST /policy_gradient`, miles/engine/rollout_gradients.py).
An engine whose memory rank 0 shares (the weight sync's rule, `WeightPusher.split`: the engine on its GPU under
`--colocate`, every engine of the host on a CPU run) adds its sum into a buffer rank 0 shares with it (a CUDA IPC
handle, a shared-memory file; one for the run, `PolicyGradientFetcher`), one engine after another: the 75 MB of
SD3.5-Medium's rank-32 gradient then never leave the GPU. Any other engine answers with the tensors in the body.
Before this, the sums went engine → driver (HTTP) → trainer (Ray): five host copies of the gradient, most of the
0.67 s the twelfth session's call measured between the rollout's end and the optimizer step.

The result is one flat fp32 vector in the trainer's own order of its adapter parameters, which
`rollout_gradient_step` broadcasts to the other ranks and cuts into their gradients.
"""

from __future__ import annotations

import math
import time
import urllib.request
from dataclasses import dataclass
from urllib.error import HTTPError

import torch

from miles.diffusion.mirrored_adamw import AdamWStep
from miles.engine.protocol import (
    CONTENT_TYPE,
    AdapterStepAnswer,
    PolicyGradientAnswer,
    ProtocolError,
    decode_policy_gradient,
    encode_optimizer_state,
    encode_policy_gradient_request,
)
from miles.engine.weight_sync import SharedBuffer
from miles.engine.weight_sync_wire import encode_buffer_ref
from miles.types import PolicyGradientAsk
from miles.utils.auth import auth_headers
from miles.utils.errors import PartDiedError


@dataclass
class FetchedGradient:
    """Rank 0's fetch: `flat` in the trainer's parameter order (None on the other ranks, which receive it by
    broadcast), how many of the `expected` samples the engines held, and what the fetch cost."""

    flat: torch.Tensor | None
    held: int
    expected: int
    seconds: float = 0.0
    engines_by_reference: int = 0
    engines_by_body: int = 0
    engine_wait_seconds: float = 0.0  # the engines' answers: waiting for their worker thread, summing (in order)
    engine_sum_seconds: float = 0.0
    # the engine's own optimizer step (miles/engine/adapter_step.py): the settings sent, the engine's answer and
    # the order it lays the adapter out in (for its moments, `push_moments`)
    step: AdamWStep | None = None
    engine_step: AdapterStepAnswer | None = None
    engine_layout: list[tuple[str, tuple[int, ...]]] | None = None


def _post(url: str, body: bytes, timeout: float, path: str = "policy_gradient") -> bytes:
    request = urllib.request.Request(f"{url}/{path}", data=body, method="POST",
                                     headers={"Content-Type": CONTENT_TYPE, **auth_headers()})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except OSError as err:  # URLError, HTTPError, a refused or dropped connection
        reason = f"{err}: {err.read().decode(errors='replace')[:300]}" if isinstance(err, HTTPError) else str(err)
        raise PartDiedError(f"--diffusion-rollout-gradient: POST {url}/{path} failed ({reason}); the engine "
                            f"holding those samples' gradients is gone or refused the request") from err


def _ask(url: str, body: bytes, timeout: float) -> PolicyGradientAnswer:
    data = _post(url, body, timeout)
    try:
        return decode_policy_gradient(data)
    except ProtocolError as err:
        raise PartDiedError(f"--diffusion-rollout-gradient: engine {url}'s policy_gradient answer is malformed "
                            f"({err})") from err


class _FlatOrder:
    """Where each adapter tensor sits in the trainer's flat gradient."""

    def __init__(self, shapes: dict[str, torch.Size]):
        self.shapes = shapes
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, shape in shapes.items():
            self.offsets[name] = offset
            offset += math.prod(shape)
        self.numel = offset

    def check(self, url: str, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        theirs = {name: tuple(shape) for name, shape in names_and_shapes}
        ours = {name: tuple(shape) for name, shape in self.shapes.items()}
        if theirs != ours:
            missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
            raise PartDiedError(f"--diffusion-rollout-gradient: engine {url}'s gradient does not match the adapter "
                                f"(missing {missing[:3]}, unknown {extra[:3]}, or other shapes)")

    def add(self, total: torch.Tensor, name: str, piece: torch.Tensor) -> None:
        offset = self.offsets[name]
        total[offset : offset + piece.numel()].add_(piece.reshape(-1).to(total.device))


class PolicyGradientFetcher:
    """Rank 0's fetches, one rollout after another, into one shared buffer kept for the run. A buffer per fetch
    (a /dev/shm file created, zeroed with its pages faulted in, unlinked) and the sum copied out of it cost ≈ 0.09 s
    of host work per rollout at SD3.5-Medium's 75 MB (rank 32) on a 2-core CPU; kept, the buffer is zeroed and,
    when the engines' order is the trainer's, handed over as it is. `shapes`: the trainer's adapter tensors by the
    names the engines know them by, in its order; `pusher`: rank 0's `WeightPusher`."""

    def __init__(self, pusher, shapes: dict[str, torch.Size], device: torch.device, timeout: float):
        self.pusher, self.device, self.timeout = pusher, device, timeout
        self.order = _FlatOrder(shapes)
        self._shared: SharedBuffer | None = None  # made at the first fetch by reference

    def engine_can_step(self, ask: PolicyGradientAsk) -> bool:
        """One engine holds the whole rollout and shares our memory: it can take the optimizer step itself."""
        urls = ask.engines
        return len(urls) == 1 and self.pusher.split(urls)[0] == urls

    def fetch(self, ask: PolicyGradientAsk, step: AdamWStep | None = None, weight_version: int = 0
              ) -> FetchedGradient:
        """Σ over engines of Σ_b c_b·G_b as one flat fp32 vector on the device, in `shapes`' order. The vector may
        be the shared buffer itself: it holds this fetch's gradient until the next fetch. With `step` (only where
        `engine_can_step`), the engine also takes that optimizer step and moves to `weight_version`."""
        began = time.perf_counter()
        urls = ask.engines
        by_reference, by_body = self.pusher.split(urls)
        if step is not None and not self.engine_can_step(ask):
            raise ValueError("an engine takes the optimizer step only when it alone holds the rollout, by reference")
        answers: list[PolicyGradientAnswer] = []
        if by_reference:
            total, held = self._added_by_reference(by_reference, ask, answers, step, weight_version)
        else:
            total, held = torch.zeros(self.order.numel, dtype=torch.float32, device=self.device), 0
        for url in by_body:
            answer = _ask(url, encode_policy_gradient_request(ask.coefficients[url]), self.timeout)
            answers.append(answer)
            gradient = answer.gradient or {}
            self.order.check(url, [(name, tuple(value.shape)) for name, value in gradient.items()])
            held += answer.samples
            for name, value in gradient.items():
                self.order.add(total, name, value)
        return FetchedGradient(total, held, ask.samples, time.perf_counter() - began, len(by_reference),
                               len(by_body), sum(a.wait_seconds for a in answers), sum(a.sum_seconds for a in answers),
                               step, answers[0].step if step is not None else None,
                               answers[0].layout if step is not None else None)

    def _added_by_reference(self, urls: list[str], ask: PolicyGradientAsk, answers: list[PolicyGradientAnswer],
                            step: AdamWStep | None = None, weight_version: int = 0) -> tuple[torch.Tensor, int]:
        """The engines at `urls` add their sums into the shared buffer, one after another; returns the sum in our
        order (the buffer itself where the engines' order is ours) and how many samples they held."""
        order = self.order
        if self._shared is None:
            self._shared = SharedBuffer(4 * order.numel, self.device)
        added = self._shared.buffer[: 4 * order.numel].view(torch.float32)
        added.zero_()
        if added.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the engines add on their own streams
        layout, held = None, 0
        for url in urls:  # one at a time: each adds into the same buffer
            into = encode_buffer_ref(self._shared.describe())
            answer = _ask(url, encode_policy_gradient_request(ask.coefficients[url], into, step, weight_version),
                          self.timeout)
            if step is not None and answer.step is None:
                raise PartDiedError(f"--rollout-gradient-engine-step: engine {url} answered without taking the step")
            answers.append(answer)
            order.check(url, answer.layout or [])
            if layout is not None and answer.layout != layout:  # the same push, so the same order, or a bug
                raise PartDiedError(f"--diffusion-rollout-gradient: engine {url} lays the gradient out in "
                                    f"another order than {urls[0]}; they cannot add into one buffer")
            held += answer.samples
            layout = answer.layout
        if [name for name, _ in layout] == list(order.shapes):
            return added, held  # the engine's order is ours (the weight sync named the pieces in it)
        total = torch.zeros(order.numel, dtype=torch.float32, device=self.device)
        offset = 0
        for name, shape in layout:
            order.add(total, name, added[offset : offset + math.prod(shape)])
            offset += math.prod(shape)
        return total, held

    def push_moments(self, url: str, layout: list[tuple[str, tuple[int, ...]]],
                     moments: dict[str, tuple[torch.Tensor, torch.Tensor]], count: int) -> None:
        """The trainer's AdamW moments after its step `count` (name -> (exp_avg, exp_avg_sq)) to the engine at
        `url`, in its `layout`: exp_avg then exp_avg_sq, through a shared-memory file made for the occasion (the
        first step after a resume or an engine's restart)."""
        numel = sum(math.prod(shape) for _, shape in layout)
        buffer = SharedBuffer(8 * numel, torch.device("cpu"))
        try:
            flat, offset = buffer.buffer[: 8 * numel].view(torch.float32), 0
            for which in range(2):
                for name, _ in layout:
                    piece = moments[name][which].reshape(-1)
                    flat[offset : offset + piece.numel()].copy_(piece)
                    offset += piece.numel()
            del flat  # the mapping closes with the buffer
            _post(url, encode_optimizer_state(count, encode_buffer_ref(buffer.describe())), self.timeout,
                  "optimizer_state")
        finally:
            buffer.close()

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
