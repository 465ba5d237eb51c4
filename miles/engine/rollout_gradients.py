"""Each sample's policy gradient, taken by the engine during the rollout (`--diffusion-rollout-gradient`).

LoRA Flow-GRPO with one optimizer step per rollout: when the trainer takes its gradient, the ratio π_θ/π_old of
every pair is exactly 1, so the clipped loss's gradient is Σ_b c_b·Σ_k ∇ℓ_{b,k} with c_b = −clip(A_b)/P (P
the rollout's train pairs; docs/algorithms.md §5). The trainer's replay forward would only recompute what the
engine's forward computed; here the engine keeps that forward's graph instead. A request that asks for it
(`GenerateRequest.rollout_gradient`) runs each of its SDE steps with autograd through the LoRA factors and
takes the backward of Σ_b ℓ_{b,k} at once; each sample's term lands in its own row of the tile's factors (per-sample
factors A_b [r, in], B_b [out, r], all equal to the pushed adapter), is added to the sample's sums over the
request's steps and kept under the sample's seed.
When the rewards are in, `POST /policy_gradient` gives Σ_b c_b·G_b for the coefficients the trainer sends (added
into a buffer the trainer shares where it can, miles/backends/fsdp_utils/gradient_fetch.py), and the trainer
steps on that: no replay, and the gradient is of the very forward that drew the sample.

A LoRA layer's value stays the merged weight's (W'x, as the engine always runs it): the per-sample term t only
appears in the backward (`_AdapterGradientTap`), so only gradients see it. The factors are the trainer's, pushed
as LoRA pairs (`--lora-ipc-weight-sync`, which the flag implies; miles.engine.weight_sync hands each pair here).
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

import torch
from torch import nn

from miles.engine.protocol import ProtocolError
from miles.utils.compile import compile_seconds

if TYPE_CHECKING:
    from miles.engine.model_runner import ModelRunner, Trajectory


@dataclass
class LoraFactors:
    """One layer's adapter as the trainer last pushed it (fp32), and the names it pushed them under."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float
    name_a: str
    name_b: str


class RolloutGradients:
    """The engine's per-sample adapter rows and the gradients they collect (one per engine process).

    Every layer's factors live in one flat fp32 vector (the layout: each layer's A then B, in the order the
    weight sync first named them), so a tile's rows are one leaf [n, P] (`tile_rows`) whose per-layer pieces are
    views, and a request's gradient sums one [M, P] tensor: a tile costs a handful of kernels, not a few per
    layer."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = modules
        self.factors: dict[str, LoraFactors] = {}  # "<module>.<layer>" -> the pushed adapter, in layout order
        self.layers: dict[str, nn.Module] = {}  # the Linear layers whose forward is wrapped
        self.gradients: dict[int, torch.Tensor] = {}  # seed -> that sample's Σ_k ∇ℓ, flat [P] in layout order
        self._flat: torch.Tensor | None = None  # every layer's factors in layout order, built once per push
        # a GPU engine's kept requests' sums, on the device or spilled, with their (seed, row) pairs: what `_move`
        # moves as one block
        self._blocks: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = []

    # ---- the adapter, from the weight sync ------------------------------------------------------------------
    def set_factors(self, module_name: str, layer_name: str, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    scaling: float) -> None:
        key = f"{module_name}.{layer_name}"
        self._flat = None
        layer = self.layers[key] if key in self.layers else self.modules[module_name].get_submodule(layer_name)
        # on the layer's device: a trainer in host memory (--rollout-gradient-trainer host) pushes them from a file
        device = layer.weight.device
        self.factors[key] = LoraFactors(lora_a.detach().to(device, torch.float32, copy=True),
                                        lora_b.detach().to(device, torch.float32, copy=True), scaling,
                                        f"{key}.lora_A.weight", f"{key}.lora_B.weight")
        if key not in self.layers:
            layer._rollout_rows = None  # (A rows, B rows, scaling) during a gradient forward, else None
            layer._rollout_base_forward = layer.forward
            # a method of the one function, not a per-layer partial: dynamo guards a forward attribute by the
            # object's id, so a partial per layer compiled each block on its own (48 graphs at SD3.5-Medium where
            # 7 do: bench/bench_engine_graphs.py), at start-up and again on every later launch
            layer.forward = types.MethodType(_forward_with_rows, layer)
            self.layers[key] = layer

    @property
    def device(self) -> torch.device:
        """Where the factors, and so the gradient sums, live."""
        self.check_pushed()
        return next(iter(self.factors.values())).a.device

    def new_weights(self) -> None:
        """A weight update finished: gradients of the previous policy that nobody asked for are dropped."""
        self.gradients.clear()
        self._blocks.clear()

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(trainer name, shape) of each piece of the flat fp32 layout, in order."""
        return [(name, tuple(shape)) for f in self.factors.values()
                for name, shape in ((f.name_a, f.a.shape), (f.name_b, f.b.shape))]

    # ---- one request's gradient sums and one tile's factor rows -----------------------------------------------
    def check_pushed(self) -> None:
        if not self.factors:
            raise ProtocolError("a rollout_gradient request before any LoRA weights were pushed to this engine "
                                "(--diffusion-rollout-gradient syncs LoRA pairs first)")

    def flat_factors(self) -> torch.Tensor:
        self.check_pushed()
        if self._flat is None:
            self._flat = torch.cat([t.reshape(-1) for f in self.factors.values() for t in (f.a, f.b)])
        return self._flat

    def sums(self, num_samples: int) -> torch.Tensor:
        """A request's per-sample gradient sums, Σ_k ∇ℓ_{b,k}: zeros [M, P] fp32 (72 MiB per sample at
        SD3.5-Medium, LoRA rank 32)."""
        flat = self.flat_factors()
        return flat.new_zeros(num_samples, flat.numel())

    def tile_rows(self, rows: int) -> torch.Tensor:
        """One tile's factors, a leaf [rows, P] whose rows are one copy expanded (stride 0: no memory); the
        backward gives each row its own gradient, which `step_with_gradients` adds to its sample's sums. (Rows
        gathered from per-request leaves were a dense copy, 602 MB per tile of 8 at SD3.5-Medium, kept for the
        forward and the backward.)"""
        return self.flat_factors().unsqueeze(0).expand(rows, -1).requires_grad_(True)

    def forward_rows(self, rows: torch.Tensor | None) -> None:
        """The factors of the next forward's samples, rows [n, P] in its row order (None: no gradient forward)."""
        if rows is None:
            for layer in self.layers.values():
                layer._rollout_rows = None
            return
        pieces = self.layout()
        parts = torch.split(rows, [math.prod(shape) for _, shape in pieces], dim=1)
        for index, (key, layer) in enumerate(self.layers.items()):
            (_, shape_a), (_, shape_b) = pieces[2 * index], pieces[2 * index + 1]
            layer._rollout_rows = (parts[2 * index].view(-1, *shape_a), parts[2 * index + 1].view(-1, *shape_b),
                                   self.factors[key].scaling)

    def keep(self, seeds: Iterable[int], sums: torch.Tensor) -> None:
        """A finished request: sample b's accumulated gradient, kept under its seed until asked for. A GPU
        engine's sums stay on the device until another wave needs the room (`spill_to_host`: the GPU holds one
        wave's sums, however many samples the rollout has, 72 MiB each at SD3.5-Medium, LoRA rank 32), and after
        the rollout's last wave the spilled ones come back (`gather_on_device`), so that the fetch sums them all
        where they are: read back at the fetch, the way over the host link took 0.13 s of it for a rollout of 32
        on an H100 (2.4 GB; bench/RESULTS.md, thirty-fifth session)."""
        seeds = list(seeds)
        for seed in seeds:
            if seed in self.gradients:
                raise ProtocolError(f"a second rollout_gradient sample with seed {seed} before the first was taken")
        rows = [(seed, sums[b]) for b, seed in enumerate(seeds)]
        self.gradients.update(rows)
        if sums.is_cuda:
            self._blocks.append((sums, rows))

    def spill_to_host(self) -> None:
        """The kept sums on the device, to pinned host memory: before another wave's sums are allocated
        (`ModelRunner.activate`) or the engine releases its memory."""
        self._move(to_host=True)

    def gather_on_device(self) -> None:
        """The spilled sums back on the device: after the rollout's last wave (the scheduler calls it once no
        other gradient request can start before the weights change), while its last results are decoded and
        scored; the steps' activations are gone by then, so they take no more than the steps' peak."""
        self._move(to_host=False)

    def _move(self, to_host: bool) -> None:
        """Each kept request's sums that are not where they should be, copied there as one block, its samples
        re-pointed to their rows. The copies are queued on the current stream, as is every later use
        (`_weighted_sum`); the caching allocators hand the memory they leave only to work queued after them."""
        self._prune()
        for index, (block, rows) in enumerate(self._blocks):
            if block.is_cuda != to_host:
                continue
            moved = (torch.empty(block.shape, dtype=block.dtype, pin_memory=True) if to_host
                     else torch.empty_like(block, device=self.device))
            moved.copy_(block, non_blocking=True)
            moved_rows = [(seed, moved[b]) for b, (seed, _) in enumerate(rows)]
            for (seed, row), (_, moved_row) in zip(rows, moved_rows):
                if self._held(seed, row):
                    self.gradients[seed] = moved_row
            self._blocks[index] = (moved, moved_rows)

    def _held(self, seed: int, row: torch.Tensor) -> bool:
        """The sample's kept gradient is still this row: not taken, nor replaced by a later sample's."""
        return self.gradients.get(seed) is row

    def _prune(self) -> None:
        """Forget the blocks whose samples were all taken (their memory is freed with them)."""
        self._blocks = [(block, rows) for block, rows in self._blocks if any(self._held(s, r) for s, r in rows)]

    # ---- the policy gradient --------------------------------------------------------------------------------
    def _weighted_sum(self, coefficients: Mapping[int, float]) -> tuple[torch.Tensor, int]:
        """Σ_b c_b·G_b, flat [P] on the engine's device, over the kept samples named in `coefficients`; those are
        dropped. A seed this engine does not hold is skipped (another engine served it)."""
        used = [seed for seed in coefficients if seed in self.gradients]
        total = torch.zeros(sum(math.prod(shape) for _, shape in self.layout()), device=self.device)
        for seed in used:  # a sample still spilled comes back from the host as it is added
            total.add_(self.gradients.pop(seed).to(total.device, non_blocking=True), alpha=float(coefficients[seed]))
        self._prune()
        return total, len(used)

    def policy_gradient(self, coefficients: Mapping[int, float]) -> tuple[dict[str, torch.Tensor], int]:
        """Σ_b c_b·G_b (seed -> c_b) by the trainer's tensor names, and how many samples it used."""
        total, used = self._weighted_sum(coefficients)
        pieces = self.layout()
        parts = torch.split(total, [math.prod(shape) for _, shape in pieces])
        return {name: part.view(shape) for (name, shape), part in zip(pieces, parts)}, used

    def add_policy_gradient(self, coefficients: Mapping[int, float], into: torch.Tensor
                            ) -> tuple[list[tuple[str, tuple[int, ...]]], int, torch.Tensor]:
        """Add Σ_b c_b·G_b as fp32 in `layout()` order into the first bytes of `into` (a flat uint8 buffer the
        trainer shared, miles/backends/fsdp_utils/gradient_fetch.py): the gradient reaches the trainer without
        leaving the device. Returns (layout, samples used, the sum on the engine's device: the engine's own
        optimizer step reads it, miles/engine/adapter_step.py)."""
        layout = self.layout()
        nbytes = 4 * sum(math.prod(shape) for _, shape in layout)
        if into.numel() < nbytes:  # checked before any kept gradient is taken
            raise ProtocolError(f"policy_gradient: the 'into' buffer holds {into.numel()} bytes, the gradient "
                                f"needs {nbytes}")
        total, used = self._weighted_sum(coefficients)
        into[:nbytes].view(torch.float32).add_(total.to(into.device))
        return layout, used, total


class _AdapterGradientTap(torch.autograd.Function):
    """The identity on a LoRA layer's output y, whose backward also hands each sample's factors the gradient of
    the adapter's term t = s·B_b A_b x̄ (x̄ the layer input, detached: x's gradient through the merged weight W'x
    already carries the adapter's share). t's value is in W'x already, so it is never formed: the forward costs a
    copy of y (the compiler fuses it into y's consumer), and the backward two thin matmuls per factor,
    u = x̄·Aᵀ then ∇B = s·gᵀu, and v = g·B then ∇A = s·vᵀx̄, without the [rows, tokens, out] intermediates that
    autograd through `t − t.detach()` would write and read. The rows of x and y are copies × samples (the
    family's doubled CFG batch): each copy's rows are a contiguous block, and a sample's gradient sums its copies.
    All copies go through each matmul as one batch (the factors repeated per copy), then the copies' parts are
    summed in fp32: four launches a layer instead of four per copy, and twice the blocks to spread over the
    device's multiprocessors at a tile of 8 under CFG (bench/bench_adapter_tap.py times both forms)."""

    @staticmethod
    def forward(ctx, y, x, a, b, scaling):
        ctx.save_for_backward(x, a, b)
        ctx.scaling = scaling
        return y.clone()  # not y itself: an output that aliases an input may not be modified in place

    @staticmethod
    def backward(ctx, grad):
        x, a, b = ctx.saved_tensors
        grad_a, grad_b = adapter_factor_gradients(x, grad.reshape(x.shape[0], -1, grad.shape[-1]), a, b)
        return grad, None, grad_a * ctx.scaling, grad_b * ctx.scaling, None


def adapter_factor_gradients(x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's gradients of its adapter term B_b·A_b·x with respect to its factors, unscaled: ∇A_b = Σ vᵀx
    (v = g·B_b) and ∇B_b = Σ gᵀu (u = x·A_bᵀ), summed over tokens and over the sample's copies. x [copies ×
    samples, tokens, in] and g [copies × samples, tokens, out] in the compute dtype, a [samples, r, in] and b
    [samples, out, r] in theirs; returns (∇A, ∇B) in the factors' dtype."""
    samples = a.shape[0]
    copies = x.shape[0] // samples
    g = g.to(x.dtype)
    low_a = a.to(x.dtype).repeat(copies, 1, 1)  # row c·samples + j is sample j's factor, as x's rows
    low_b = b.to(x.dtype).repeat(copies, 1, 1)
    u = torch.bmm(x, low_a.transpose(1, 2))  # [rows, tokens, r]
    v = torch.bmm(g, low_b)  # [rows, tokens, r]
    part_b = torch.bmm(g.transpose(1, 2), u).to(b.dtype)  # [rows, out, r]
    part_a = torch.bmm(v.transpose(1, 2), x).to(a.dtype)  # [rows, r, in]
    return part_a.view(copies, *a.shape).sum(0), part_b.view(copies, *b.shape).sum(0)


def _forward_with_rows(layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The layer's own forward; during a gradient forward its output goes through `_AdapterGradientTap` with
    each sample's factors (rows = copies × samples under CFG)."""
    y = layer._rollout_base_forward(x, *args, **kwargs)
    rows = layer._rollout_rows
    if rows is None:
        return y
    a, b, scaling = rows
    if x.shape[0] % a.shape[0]:
        raise RuntimeError(f"a gradient forward of {x.shape[0]} rows for {a.shape[0]} samples")
    return _AdapterGradientTap.apply(y, x.detach().reshape(x.shape[0], -1, x.shape[-1]), a, b, scaling)


# ---- the engine's gradient step ----------------------------------------------------------------------------
def step_with_gradients(runner: ModelRunner, trajectories: list[Trajectory]) -> None:
    """One SDE step of rollout_gradient trajectories: per tile of samples, the forward with autograd through
    each sample's row of the LoRA factors, the step kernel (x' drawn from the detached velocity, as in
    `_apply_step`), then the backward of Σ_b ℓ_b at once, so only one tile's activations live at a time. A tile
    is the trainer's micro-batch of samples (`rollout_gradient_tile`); the last one is padded by repeating its
    last sample when the engine runs fixed tiles (the batch_invariant group) or compiled graphs."""
    began, compiled_before = time.perf_counter(), compile_seconds()
    first = trajectories[0]
    guidance, shape = first.request.guidance, first.shape
    rows = [(t, b) for t in trajectories for b in range(t.num_samples)]
    tile = runner.server_args.rollout_gradient_tile
    pad = bool(runner.server_args.forward_tile or runner.server_args.enable_torch_compile)
    next_latents: dict[int, list[torch.Tensor]] = {id(t): [] for t in trajectories}
    log_probs: dict[int, list[torch.Tensor]] = {id(t): [] for t in trajectories}
    for lo in range(0, len(rows), tile):
        segments = _segments(rows[lo : lo + tile])
        count = sum(end - start for _, start, end in segments)

        def gather(pick) -> torch.Tensor:
            part = torch.cat([pick(t)[start:end] for t, start, end in segments])
            if pad and count < tile:  # the fixed tile: repeat the last sample
                part = torch.cat([part, part[-1:].expand(tile - count, *part.shape[1:])])
            return part

        latents = gather(lambda t: t.latents)
        sigmas = gather(lambda t: t.sigmas[t.step].expand(t.num_samples))
        conditioning = {key: gather(lambda t, key=key: t.conditioning[key]) for key in first.conditioning}
        factors = runner.rollout_gradients.tile_rows(tile if pad else count)
        with torch.enable_grad():
            runner.rollout_gradients.forward_rows(factors)
            try:
                velocity = runner.family.predict_velocity(runner.forward_modules, latents, sigmas, conditioning,
                                                          guidance, shape, runner.dtype).float()[:count]
            finally:
                runner.rollout_gradients.forward_rows(None)
            total, offset = velocity.new_zeros(()), 0
            for t, start, end in segments:
                v = velocity[offset : offset + end - start]
                offset += end - start
                x, k, m = t.latents[start:end], t.step, end - start
                step = (t.sigmas[k].expand(m), t.sigmas[k + 1].expand(m), t.sigmas[1].expand(m))
                drawn = t.backend.sample(x, v.detach(), *step, t.generators[start:end])
                total = total + t.backend.log_prob(x, v, drawn.next_latents, *step).log_prob.sum()
                next_latents[id(t)].append(drawn.next_latents)
                log_probs[id(t)].append(drawn.log_prob)
                if t.request.debug:
                    t.debug_velocities.setdefault(k, []).append(v.detach())
            total.backward()  # each sample's ∇ℓ into its own row of the factors
        offset = 0
        for t, start, end in segments if factors.grad is not None else []:  # the padding rows (no log-prob): out
            t.gradient_sums[start:end] += factors.grad[offset : offset + end - start]
            offset += end - start
    for t in trajectories:
        k = t.step
        t.latents = torch.cat(next_latents[id(t)])
        t.log_probs[k] = torch.cat(log_probs[id(t)])
        if t.request.debug:
            t.debug_velocities[k] = torch.cat(t.debug_velocities[k])
        t.step = k + 1
        runner.record_latents(t)
    elapsed, compiling = time.perf_counter() - began, compile_seconds() - compiled_before
    for t in trajectories:
        t.denoise_seconds += elapsed
        t.compile_seconds += compiling


def _segments(rows: list[tuple[Trajectory, int]]) -> list[tuple[Trajectory, int, int]]:
    """(trajectory, first sample, end) runs of consecutive samples of one trajectory, in row order."""
    segments: list[tuple[Trajectory, int, int]] = []
    for t, b in rows:
        if segments and segments[-1][0] is t and segments[-1][2] == b:
            segments[-1] = (t, segments[-1][1], b + 1)
        else:
            segments.append((t, b, b + 1))
    return segments
