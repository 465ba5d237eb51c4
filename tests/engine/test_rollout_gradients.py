"""miles/engine/rollout_gradients.py: the gradient an engine takes during the rollout is the trainer's.

A tiny SD3 with CFG on the CPU in fp32: the trainer (LoRA, a trained-looking adapter: B ≠ 0) pushes its LoRA
pairs to an engine through the real weight receiver; the engine denoises a rollout_gradient request; the
trainer then replays the same trajectories on its clipped loss. The engine's Σ_b c_b·G_b (c_b = −A_b/P) is that
replay's gradient, and asking for it changes nothing the engine returns.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.rollout_gradient_step import adapter_params_by_pushed_name
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.backends.fsdp_utils.weight_export import iter_named_tensors, lora_scaling
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import GenerateRequest, ProtocolError
from miles.engine.server_args import ServerArgs
from miles.engine.weight_sync import WeightReceiver, SharedBuffer
from miles.engine.weight_sync_wire import UpdateMessage
from miles.testing.tiny_rollout import build_tiny_family, samples_through_the_engine, tiny_trainer_config
from miles.types import GuidanceConfig

STEPS, SAMPLES, NOISE_LEVEL = 3, 4, 0.9


@pytest.fixture
def one_rank_group():
    init_distributed(0, 1, "gloo", free_port())
    yield
    dist.destroy_process_group()


def _request(rollout_gradient: bool) -> GenerateRequest:
    return GenerateRequest(prompt="a red cube", num_samples=SAMPLES, seed=7, num_steps=STEPS, height=32, width=32,
                           guidance=GuidanceConfig(guidance_scale=3.5), noise_level=NOISE_LEVEL,
                           sde_step_indices=list(range(STEPS)),
                           return_latent_indices=list(range(STEPS + 1)), rollout_gradient=rollout_gradient)


def _push_lora_pairs(trainer, receiver: WeightReceiver) -> None:
    named = list(iter_named_tensors(trainer, lora_only=True))
    buffer = SharedBuffer(sum(t.numel() * 4 for _, t in named) + 4096 * len(named), torch.device("cpu"))
    try:
        entries = buffer.pack(named)
        receiver.apply(UpdateMessage(weight_version=1, lora=True, lora_scaling=lora_scaling(trainer),
                                     buffer=buffer.describe(), entries=entries))
    finally:
        buffer.close()


def _trainer_with_a_trained_looking_adapter(path: str):
    """A one-rank LoRA trainer on the CPU whose B factors are random: with B = 0 the factor A would get no
    gradient at all."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer

    config = tiny_trainer_config(path, use_lora=True, diffusion_num_steps=STEPS, diffusion_guidance_scale=3.5,
                                 diffusion_noise_level=NOISE_LEVEL, micro_batch_size=3, clip_grad=0.0,
                                 diffusion_clip_range=1.0, rollout_batch_size=1, n_samples_per_prompt=SAMPLES,
                                 global_batch_size=SAMPLES)
    family = build_tiny_family(config)
    trainer = DiffusionTrainer(config, family)
    trainer.init()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in trainer.trainable:
            if "lora_B" in name:
                local = param.to_local() if hasattr(param, "to_local") else param  # one rank: the whole tensor
                local.copy_(0.1 * torch.randn(local.shape, generator=generator))
    return config, family, trainer


def _replay_gradients(trainer, samples) -> dict[str, torch.Tensor]:
    """The trainer's replay of `samples` (the clipped loss at ratio 1, one optimizer step): each adapter's
    gradient by the name the engines know it by."""
    trainer.train(0, samples)
    return {name: param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            for name, param in adapter_params_by_pushed_name(trainer).items()}


def test_the_engines_gradient_is_the_trainers_replay_gradient(tiny_checkpoint, one_rank_group):
    path = tiny_checkpoint("sd3")
    config, family, trainer = _trainer_with_a_trained_looking_adapter(path)
    pipe = family.load_pipeline(path, torch.float32)
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="fp32", generator_device="cpu",
                                    forward_tile=config.sampling.parity_forward_tile,
                                    rollout_gradient_tile=config.data.micro_batch_size),
                         loaded=(family, pipe))
    with pytest.raises(ProtocolError, match="before any LoRA weights"):
        runner.start(_request(rollout_gradient=True))
    _push_lora_pairs(trainer, WeightReceiver(runner.modules, on_lora_pair=runner.rollout_gradients.set_factors))

    plain = samples_through_the_engine(runner, _request(rollout_gradient=False))
    samples = samples_through_the_engine(runner, _request(rollout_gradient=True))
    for a, b in zip(plain, samples):  # the gradient forward samples exactly what the plain one does
        assert torch.equal(a.image, b.image) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
        assert a.advantage == b.advantage
        assert a.conditioning and not b.conditioning  # nothing replays a rollout_gradient sample: no prompt sent

    pairs = SAMPLES * STEPS  # c_b = −clip(A_b)/P written out: the test does not borrow the code it checks
    coefficients = {s.seed: -min(max(s.advantage, -5.0), 5.0) / pairs for s in samples}
    gradient, held = runner.rollout_gradients.policy_gradient(coefficients)
    assert held == SAMPLES and runner.rollout_gradients.gradients == {}  # taken once

    # two requests stepped together share tiles (rows of both in one forward): each keeps its own gradients
    first, second = (runner.start(replace(_request(rollout_gradient=True), num_samples=2, seed=seed))
                     for seed in (7, 9))
    while not first.done:
        runner.step([first, second])
    runner.finish(first), runner.finish(second)
    together, held_together = runner.rollout_gradients.policy_gradient(coefficients)
    assert held_together == SAMPLES
    for name in gradient:
        torch.testing.assert_close(together[name], gradient[name], rtol=1e-4, atol=1e-6)

    replays = _replay_gradients(trainer, plain)  # the replay of the same samples
    assert set(replays) == set(gradient) and any("lora_A" in n for n in replays)
    scale = max(float(r.abs().max()) for r in replays.values())
    # the last block's context projections feed nothing (SD3's context_pre_only block): their gradient is 0
    assert sum(bool(r.abs().max() > 0) for r in replays.values()) > 0.8 * len(replays)
    for name, replay in replays.items():
        torch.testing.assert_close(gradient[name], replay, rtol=1e-4, atol=1e-5 * scale, msg=name)



ON_A_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="an engine on a GPU")])


@pytest.mark.parametrize("engine_device", ["cpu", ON_A_GPU])
def test_an_engine_takes_its_factors_from_and_adds_its_gradient_into_host_memory(tiny_checkpoint, one_rank_group,
                                                                                   engine_device):
    """`--rollout-gradient-trainer host`: the trainer's adapter, in host memory, reaches an engine (on the GPU,
    the case that flag is for) through a shared-memory file, and the engine adds its gradient into another; that
    gradient is the CPU trainer's replay of the engine's samples."""
    path = tiny_checkpoint("sd3")
    config, family, trainer = _trainer_with_a_trained_looking_adapter(path)
    device = torch.device(engine_device)
    runner = ModelRunner(ServerArgs(model_path=path, device=engine_device, dtype="fp32", generator_device=engine_device,
                                    forward_tile=config.sampling.parity_forward_tile,
                                    rollout_gradient_tile=config.data.micro_batch_size),
                         loaded=(family, family.load_pipeline(path, torch.float32, device)))
    _push_lora_pairs(trainer, WeightReceiver(runner.modules, on_lora_pair=runner.rollout_gradients.set_factors))
    assert all(f.a.device.type == f.b.device.type == device.type for f in runner.rollout_gradients.factors.values())
    plain = samples_through_the_engine(runner, _request(rollout_gradient=False))  # the same draws, to replay
    samples = samples_through_the_engine(runner, _request(rollout_gradient=True))
    pairs = SAMPLES * STEPS
    coefficients = {s.seed: -min(max(s.advantage, -5.0), 5.0) / pairs for s in samples}
    layout = runner.rollout_gradients.layout()
    into = SharedBuffer(4 * sum(torch.Size(shape).numel() for _, shape in layout), torch.device("cpu"))
    try:
        into.buffer.zero_()
        _, held, _ = runner.rollout_gradients.add_policy_gradient(coefficients, into.buffer)
        flat = into.buffer.view(torch.float32).clone()
    finally:
        into.close()
    assert held == SAMPLES
    replays = _replay_gradients(trainer, plain)  # on the CPU, what the engine drew on the GPU
    scale = max(float(r.abs().max()) for r in replays.values())
    offset = 0
    for name, shape in layout:
        size = torch.Size(shape).numel()
        torch.testing.assert_close(flat[offset:offset + size].view(shape), replays[name], rtol=1e-3,
                                   atol=1e-4 * scale, msg=name)
        offset += size

def test_per_sample_gradients_are_kept_by_seed_and_dropped_with_new_weights():
    layer = torch.nn.Linear(3, 2)
    gradients = __import__("miles.engine.rollout_gradients", fromlist=["RolloutGradients"]).RolloutGradients(
        {"transformer": torch.nn.ModuleDict({"proj": layer})})
    gradients.set_factors("transformer", "proj", torch.ones(1, 3), torch.ones(2, 1), 0.5)
    rows = gradients.tile_rows(2)
    assert rows.stride(0) == 0  # one copy of the factors, whatever the tile
    gradients.forward_rows(rows)
    layer(torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]])).sum().backward()
    gradients.forward_rows(None)
    sums = gradients.sums(2)
    sums += rows.grad
    gradients.keep([10, 11], sums)
    with pytest.raises(ProtocolError, match="seed 10"):
        gradients.keep([10], sums)
    gradient, held = gradients.policy_gradient({10: 1.0, 99: 5.0})  # seed 99 was served elsewhere
    assert held == 1 and set(gradients.gradients) == {11}
    # sample 0: y = W'x + 0.5·B·A·x̄ with x = (1, 2, 3): ∂Σy/∂A = 0.5·(Σ_out B)·x = (1, 2, 3)
    torch.testing.assert_close(gradient["transformer.proj.lora_A.weight"], torch.tensor([[1.0, 2.0, 3.0]]))
    torch.testing.assert_close(gradient["transformer.proj.lora_B.weight"], torch.tensor([[3.0], [3.0]]))
    gradients.new_weights()
    assert gradients.gradients == {}


@pytest.mark.parametrize("device", ["cpu", ON_A_GPU])
def test_kept_sums_leave_the_device_for_another_wave_and_come_back_after_the_last(device):
    """A GPU engine keeps a finished request's sums where they were summed; `spill_to_host` (the next wave, a
    release) moves those not yet taken to the host, each to its own sample, and `gather_on_device` (after the last
    wave) brings them back, so that the fetch sums every sample without crossing the host link."""
    layer = torch.nn.Linear(3, 2).to(device)
    gradients = __import__("miles.engine.rollout_gradients", fromlist=["RolloutGradients"]).RolloutGradients(
        {"transformer": torch.nn.ModuleDict({"proj": layer})})
    gradients.set_factors("transformer", "proj", torch.ones(1, 3), torch.ones(2, 1), 0.5)  # P = 3 + 2

    def flat(gradient):
        return torch.cat([gradient[name].reshape(-1) for name, _ in gradients.layout()]).cpu()

    first = torch.arange(10, dtype=torch.float32, device=device).view(2, 5)
    gradients.keep([1, 2], first)
    assert all(g.device.type == device for g in gradients.gradients.values())
    taken, _ = gradients.policy_gradient({2: 1.0})  # asked for before any spill: read where it is
    torch.testing.assert_close(flat(taken), first[1].cpu())
    later = torch.full((1, 5), 7.0, device=device)
    gradients.keep([2], later)  # the same seed again (a later request): its own sums, not the taken ones
    gradients.spill_to_host()
    assert set(gradients.gradients) == {1, 2} and all(not g.is_cuda for g in gradients.gradients.values())
    gradients.spill_to_host()  # nothing left on the device: nothing moves
    gradients.keep([3], torch.full((1, 5), -1.0, device=device))  # the last wave's, kept where it was summed
    gradients.gather_on_device()  # after the last wave: the spilled ones back
    assert all(g.device.type == device for g in gradients.gradients.values())
    total, used = gradients.policy_gradient({1: 2.0, 2: 1.0, 3: 3.0})
    assert used == 3 and gradients.gradients == {} and gradients._blocks == []
    torch.testing.assert_close(flat(total), 2 * first[0].cpu() + later[0].cpu() - 3.0)


def test_a_compiled_engine_compiles_each_block_variant_once_with_the_gradient_tap():
    """The tap wraps every LoRA target layer's forward. Dynamo guards a forward attribute by identity, so a
    wrapper object per layer compiled every block on its own (24 graphs at SD3.5-Medium where 3 block variants
    exist), at start-up and on every later launch. The shapes base has 4 blocks of 2 variants (SD3's last block
    takes no context output). Its gradient step compiles 3 graphs (the first block's input needs no gradient, the
    rest do) and its plain step 2; a wrapper per layer made that 8."""
    from torch._dynamo.utils import counters

    from miles.models.sd3 import SD3_LORA_TARGETS
    from miles.tasks.shapes import PRETRAINED_SD3

    path = PRETRAINED_SD3
    torch._dynamo.reset()
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="fp32", generator_device="cpu",
                                    enable_torch_compile=True, rollout_gradient_tile=2))
    transformer = runner.modules["transformer"]
    generator = torch.Generator().manual_seed(0)
    for name, layer in transformer.named_modules():
        if name.startswith("transformer_blocks") and name.endswith(SD3_LORA_TARGETS):
            a = 0.1 * torch.randn(4, layer.in_features, generator=generator)
            runner.rollout_gradients.set_factors("transformer", name, a, torch.zeros(layer.out_features, 4), 2.0)
    blocks = transformer.transformer_blocks
    variants = len({bool(block.context_pre_only) for block in blocks})
    assert len(blocks) > variants
    before = counters["stats"]["unique_graphs"]
    request = GenerateRequest(prompt="two red circles", num_samples=2, seed=3, num_steps=2, height=32, width=32,
                              guidance=GuidanceConfig(guidance_scale=1.0), noise_level=0.9, sde_step_indices=[0],
                              rollout_gradient=True, return_images=False)
    samples_through_the_engine(runner, request)  # step 0 with the gradient, step 1 without
    assert counters["stats"]["unique_graphs"] - before == (variants + 1) + variants


def test_rollout_gradient_requests_run_in_waves_with_the_same_gradients(tiny_checkpoint):
    """The scheduler denoises rollout_gradient requests a wave at a time (`gradient_wave` samples: the server
    gives it one tile), so the GPU holds one wave's gradient sums whatever the rollout's size; the gradients are
    those of the requests run all at once."""
    import asyncio

    from miles.engine.scheduler import StepScheduler
    from miles.models.sd3 import SD3_LORA_TARGETS

    path = tiny_checkpoint("sd3")

    def runner() -> ModelRunner:
        engine = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="fp32", generator_device="cpu",
                                        rollout_gradient_tile=2))
        generator = torch.Generator().manual_seed(0)
        for name, layer in engine.modules["transformer"].named_modules():
            if name.startswith("transformer_blocks") and name.endswith(SD3_LORA_TARGETS):
                engine.rollout_gradients.set_factors(
                    "transformer", name, 0.1 * torch.randn(4, layer.in_features, generator=generator),
                    0.1 * torch.randn(layer.out_features, 4, generator=generator), 2.0)
        return engine

    def request(seed: int) -> GenerateRequest:
        return replace(_request(rollout_gradient=True), num_samples=2, seed=seed, return_latent_indices=[])

    async def rollout(wave: int):
        scheduler = StepScheduler(runner(), max_batch_size=32, batch_wait_ms=20.0, gradient_wave=wave)
        scheduler.start()
        try:
            responses = await asyncio.gather(*(scheduler.generate(request(seed)) for seed in (100, 200, 300)))
        finally:
            await scheduler.stop()
        coefficients = {seed + b: 0.1 * (seed // 100) - 0.05 * b for seed in (100, 200, 300) for b in range(2)}
        gradient, held = scheduler.runner.rollout_gradients.policy_gradient(coefficients)
        assert held == 6
        # each request's step clock spans the engine's steps from its start to its end: waves one after another,
        # requests of one wave the same steps; over all of them, the engine's whole denoising time
        spans = sorted((r.timings["step_clock_start"], r.timings["step_clock_end"]) for r in responses)
        assert spans[0][0] == 0.0 and max(end for _, end in spans) == scheduler.counters.step_seconds
        if wave:
            assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:]))
        else:
            assert len(set(spans)) == 1
        # the rollout's kept sums gathered on the device once, after its last wave (a no-op on the CPU)
        assert scheduler.counters.gradient_gathers == 1
        # with waves, the later requests were encoded while the first wave stepped, not all before its first step
        assert (scheduler.counters.deferred_starts > 0) == bool(wave)
        return scheduler.counters.max_forward_samples, gradient

    largest_wave, in_waves = asyncio.run(rollout(2))
    largest_together, together = asyncio.run(rollout(0))
    assert largest_wave == 2 and largest_together == 6  # one request at a time, against all three at once
    for name, value in together.items():
        torch.testing.assert_close(in_waves[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert any(value.abs().max() > 0 for value in together.values())


def test_a_compiled_rollout_gradient_engine_lets_the_compiler_fuse_and_keeps_its_fixed_tiles(tiny_checkpoint):
    """The batch_invariant group's opaque kernels and eager rounding give a compiled engine the trainer's bits; no
    trainer forward reproduces a rollout-gradient engine's, so such an engine installs neither, and keeps the
    group's fixed forward tile (what keeps a sample's bits whatever shares its batch). A plain engine of the same
    group installs both."""
    import torch._inductor.config as inductor_config

    path = tiny_checkpoint("sd3")

    def opaque_layers(gradient_tile: int) -> tuple[bool, int, int]:
        with inductor_config.patch(emulate_precision_casts=False):  # the constructor sets it in this thread
            runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="fp32", generator_device="cpu",
                                            enable_torch_compile=True, rollout_patch_group=["batch_invariant"],
                                            forward_tile=2, rollout_gradient_tile=gradient_tile))
        blocks = runner.modules["transformer"].transformer_blocks
        return (runner.eager_rounding, runner.server_args.forward_tile,
                sum(bool(getattr(sub, "_miles_opaque", False)) for sub in blocks.modules()))

    eager_rounding, tile, opaque = opaque_layers(gradient_tile=0)
    assert eager_rounding and tile == 2 and opaque > 0
    assert opaque_layers(gradient_tile=2) == (False, 2, 0)


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_the_taps_factor_gradients_are_each_samples_autograd_gradient_of_its_adapter_term_over_its_copies(copies):
    from miles.engine.rollout_gradients import adapter_factor_gradients

    torch.manual_seed(0)
    samples, tokens, d_in, d_out, rank = 3, 5, 6, 7, 2
    x = torch.randn(copies * samples, tokens, d_in, dtype=torch.float64)
    g = torch.randn(copies * samples, tokens, d_out, dtype=torch.float64)
    a = torch.randn(samples, rank, d_in, dtype=torch.float64, requires_grad=True)
    b = torch.randn(samples, d_out, rank, dtype=torch.float64, requires_grad=True)
    rows = torch.arange(copies * samples) % samples  # copy c's rows are samples 0..samples-1 again
    term = torch.einsum("nor,nri,nti->nto", b[rows], a[rows], x)  # each row's B_b A_b x
    (term * g).sum().backward()
    grad_a, grad_b = adapter_factor_gradients(x, g, a.detach(), b.detach())
    torch.testing.assert_close(grad_a, a.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_b, b.grad, rtol=1e-12, atol=1e-12)
