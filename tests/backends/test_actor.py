"""The FSDP2 trainer on a tiny SD3 (CPU, gloo, one rank): alignment, gradients, micro-batch invariance, losses,
hooks, determinism, bad settings. DP = 2 against DP = 1 runs with two Ray actors in tests/ray/test_train_actor.py."""

from __future__ import annotations

import copy
from dataclasses import replace
import os
import re

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.optimizer_parking import optimizer_state_bytes
from miles.backends.fsdp_utils.parallel_dims import ParallelDims
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.backends.fsdp_utils.train_data import TrainBatch
from miles.diffusion.sde import build_sde_backend
from miles.testing.config import trainer_config
from miles.testing.tiny_rollout import load_tiny_family, make_rollout_samples, tiny_trainer_config, trained_state
from miles.utils.errors import MilesUserError

SDE_STEPS = [1, 2]


@pytest.fixture(scope="module")
def world():
    """This process as a one-rank gloo group, NCCL for CUDA tensors where there is a GPU (the spawned DP = 2 test
    makes its own)."""
    torch.set_num_threads(1)
    init_distributed(0, 1, "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", free_port())
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, world):
    args = tiny_trainer_config(tiny_checkpoint("sd3"))
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, SDE_STEPS, seed=5, debug=True)
    return args, family, pipe, samples


def make_trainer(tiny, **overrides) -> DiffusionTrainer:
    base_args, family, _, _ = tiny
    args = tiny_trainer_config(base_args.model.hf_checkpoint, **overrides)
    trainer = DiffusionTrainer(args, family)
    assert trainer.init() == 0
    return trainer


def grads(trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in trainer.trainable}


def test_train_rollout_alignment_is_exact_in_fp32(tiny):
    """Same weights + inputs ⇒ v_trainer == v_engine bitwise and ℓ_new == ℓ_rollout to fp32 rounding (§11.7)."""
    trainer = make_trainer(
        tiny,
        debug_skip_optimizer_step=True,
        diffusion_debug_mode=True,
        micro_batch_size_sample=4,  # one tile = the rollout's batch of 4 samples at one step
        micro_batch_size_tstep=1,
        diffusion_train_iter_order="timestep_major",
    )
    before = trained_state(trainer)
    metrics = trainer.train(0, tiny[3])
    assert metrics["train/model_output_max_abs_diff"] == 0.0  # the DiT forwards agree bit for bit
    # The engine scores x' from ε (SAMPLE mode), the trainer from x' − μ (SCORE mode): the same number up to
    # fp32 rounding of x' = μ + s·ε (§11.6 allows 1e-6), so the ratio is 1 within one ulp.
    assert metrics["train/rollout_train_log_prob_abs_diff"] <= 1e-6
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6
    assert metrics["train/clipfrac"] == 0.0 and metrics["train/approx_kl"] <= 1e-12
    assert "train/grad_norm" not in metrics
    after = trained_state(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)  # --debug-skip-optimizer-step: weights never drift


def test_policy_loss_gradient_matches_closed_form(tiny):
    """§11.9: at ρ ≡ 1 (recompute, window 0) ∇L = −mean_j(A_c,j ∇ℓ_new,j), A_c = clamp(A, −5, 5)."""
    args, family, _, samples = tiny
    chosen = [samples[0], samples[3]]
    chosen[0].advantage, chosen[1].advantage = 7.0, -0.75  # 7 is clipped to 5
    trainer = make_trainer(
        tiny, use_lora=True, diffusion_recompute_old_log_prob=True, clip_grad=0.0, lr=0.0, micro_batch_size=1
    )
    trainer.train(0, chosen)
    got = grads(trainer)

    # independent reference: a plain (unsharded) transformer with the same LoRA weights, autograd per pair
    modules = family.load_modules(args.model.hf_checkpoint, ["transformer"], torch.float32)
    reference = modules["transformer"]
    reference.add_adapter(trainer.lora_config)
    state = trained_state(trainer)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if f"transformer.{name}" in state:
                param.copy_(state[f"transformer.{name}"])
    lora_params = {f"transformer.{n}": p for n, p in reference.named_parameters() if "lora_" in n}
    sde = build_sde_backend("sde", args.sampling.diffusion_noise_level, False)
    expected = {name: torch.zeros_like(p) for name, p in lora_params.items()}
    num_pairs = 2 * len(SDE_STEPS)
    for sample, clipped_adv in zip(chosen, (5.0, -0.75)):
        for j, k in enumerate(sample.sde_step_indices):
            cond = {key: value[None] for key, value in sample.conditioning.items()}
            velocity = family.predict_velocity(
                modules, sample.latents[k][None], sample.sigmas[k : k + 1], cond, trainer.guidance, trainer.shape, torch.float32
            )
            log_prob = sde.log_prob(
                sample.latents[k][None], velocity, sample.latents[k + 1][None], sample.sigmas[k], sample.sigmas[k + 1], sample.sigmas[1]
            ).log_prob.sum()
            pair_grads = torch.autograd.grad(log_prob, list(lora_params.values()))
            for name, g in zip(lora_params, pair_grads):
                expected[name] += -clipped_adv * g / num_pairs
    assert set(got) == set(expected)
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6 * scale)


def test_flat_and_tile_micro_batches_give_the_same_gradients(tiny):
    """§11.12: Σ/Q per micro-batch makes the window gradient independent of the micro-batch shape."""
    samples = tiny[3]
    layouts = [
        dict(micro_batch_size=1),
        dict(micro_batch_size=8),
        dict(micro_batch_size_sample=2, micro_batch_size_tstep=2),
        dict(micro_batch_size_sample=4, micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major"),
    ]
    results = []
    for layout in layouts:
        trainer = make_trainer(tiny, lr=0.0, clip_grad=0.0, **layout)
        metrics = trainer.train(0, samples)
        results.append((grads(trainer), metrics["train/loss"]))
    reference, reference_loss = results[0]
    assert max(float(g.abs().max()) for g in reference.values()) > 0
    for got, loss in results[1:]:
        assert loss == pytest.approx(reference_loss, rel=1e-5, abs=1e-9)
        for name in reference:
            torch.testing.assert_close(got[name], reference[name], rtol=1e-4, atol=1e-7)


def test_kl_to_lora_base_is_zero_at_init_and_nft_sft_run(tiny):
    """§11.11: KL = 0 while policy == reference (LoRA B = 0); NFT with an EMA reference and SFT train."""
    samples = tiny[3]
    kl = make_trainer(tiny, use_lora=True, diffusion_kl_beta=0.04, micro_batch_size=4)
    assert kl.ref_mode == "lora_base"
    assert kl.train(0, samples)["train/kl_loss"] == 0.0
    assert kl.train(1, samples)["train/kl_loss"] > 0.0  # after an update the adapters move the mean

    removed = [copy.copy(sample) for sample in samples]
    for sample in removed:
        sample.remove_sample = True
    assert train_metrics_without_steps(make_trainer(tiny, micro_batch_size=4), removed) == {"train/num_pairs": 0.0}

    nft = make_trainer(tiny, loss_type="nft", use_lora=True, use_ema=True, micro_batch_size=3)
    assert nft.ref_mode == "ema"
    metrics = nft.train(0, samples)
    assert metrics["train/ema_num_updates"] == 1.0
    assert 0.0 <= metrics["train/nft_r_mean"] <= 1.0 and torch.isfinite(torch.tensor(metrics["train/nft_loss"]))
    sft = make_trainer(tiny, loss_type="sft_loss", micro_batch_size=2)
    assert sft.train(0, samples)["train/sft_loss"] > 0


def train_metrics_without_steps(trainer, samples):
    metrics = trainer.train(0, samples)
    assert trainer.global_step == 0
    return {k: v for k, v in metrics.items() if k.startswith("train/")}


def advantage_times_log_prob(args, inputs):
    loss = -inputs.advantages * inputs.new_log_prob
    return loss, {"custom_metric": torch.full_like(loss, 3.0)}


def nan_loss_for_sample_one(args, inputs):
    """The policy loss, but NaN on every pair of sample 1, where its gradient stays finite (a masked-out NaN)."""
    loss = -inputs.advantages * inputs.new_log_prob
    return torch.where(inputs.sample_indices.to(loss.device) == 1, torch.full_like(loss, float("nan")), loss), {}


def nan_gradient_for_sample_one(args, inputs):
    """The policy loss times NaN on sample 1: the loss and its gradient are NaN (e.g. a division by a zero std)."""
    loss = -inputs.advantages * inputs.new_log_prob
    factor = torch.where(inputs.sample_indices == 1, float("nan"), 1.0).to(loss.device)
    return loss * factor, {}


def zero_advantages(args, batch: TrainBatch) -> TrainBatch:
    batch.advantages = torch.zeros_like(batch.advantages)
    return batch


def test_custom_loss_and_prepare_batch_hooks(tiny):
    samples = tiny[3]
    custom = make_trainer(
        tiny, loss_type="custom_loss", custom_loss_function_path=f"{__name__}.advantage_times_log_prob", micro_batch_size=4
    )
    metrics = custom.train(0, samples)
    assert metrics["train/custom_metric"] == 3.0 and metrics["train/loss"] != 0.0
    prepared = make_trainer(tiny, custom_prepare_train_batch_path=f"{__name__}.zero_advantages", micro_batch_size=4)
    metrics = prepared.train(0, samples)
    assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0


@pytest.mark.parametrize("nan_loss, gradient_norm", [("nan_loss_for_sample_one", r"[0-9.e+-]+"),
                                                     ("nan_gradient_for_sample_one", "nan")])
def test_a_nan_loss_skips_its_optimizer_step_with_a_warning_and_a_metric(tiny, caplog, nan_loss, gradient_norm):
    """Two optimizer windows, sample-major: step 1 trains samples 0-1 (NaN on sample 1), step 2 samples 2-3."""
    flags = dict(loss_type="custom_loss", micro_batch_size=4, num_steps_per_rollout=2)
    clean = make_trainer(tiny, custom_loss_function_path=f"{__name__}.advantage_times_log_prob", **flags)
    broken = make_trainer(tiny, custom_loss_function_path=f"{__name__}.{nan_loss}", **flags)
    before = trained_state(broken)
    with caplog.at_level("WARNING", logger="miles.backends.fsdp_utils.actor"):
        metrics = broken.train(0, tiny[3])
    assert clean.train(0, tiny[3])["train/skipped_steps"] == 0.0 and clean.global_step == 2
    assert metrics["train/skipped_steps"] == 1.0 and broken.global_step == 1  # the LR schedule moved once
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))  # the mean over the step that was taken
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and re.fullmatch(
        rf"rollout 0, step 1/2: non-finite loss or gradient \(loss finite: False, gradient norm {gradient_norm}\); "
        r"optimizer step skipped, weights unchanged", warnings[0]), warnings
    after = trained_state(broken)
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in before)  # step 2 did update the weights


def test_deterministic_mode_runs_are_bitwise_equal(tiny):
    runs = []
    try:
        for _ in range(2):
            trainer = make_trainer(tiny, deterministic_mode=True, use_lora=True, micro_batch_size=2, num_rollout=2)
            losses = [trainer.train(rollout_id, tiny[3])["train/loss"] for rollout_id in (0, 1)]
            runs.append((losses, trained_state(trainer)))
    finally:
        torch.use_deterministic_algorithms(False)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(diffusion_kl_beta=0.1), "needs --use-lora"),
        (dict(ref_mode="ema"), "--ref-mode ema needs --use-ema"),
        (dict(use_ema=True), "--use-ema has no consumer"),
        (dict(ema_rollout_policy="ema"), "--ema-rollout-policy ema needs --use-ema"),
        (dict(loss_type="nft", diffusion_recompute_old_log_prob=True), "only applies to --loss-type policy_loss"),
        (dict(loss_type="dpo"), "--loss-type must be one of"),
        (dict(diffusion_sde_type="ode"), "needs a stochastic rollout"),
        (dict(loss_type="custom_loss"), "--custom-loss-function-path go together"),
    ],
)
def test_bad_settings_fail_before_any_work(tiny, overrides, message):
    """The trainer's settings are checked once, by the validation rules, before a trainer exists."""
    with pytest.raises(MilesUserError, match=message):
        tiny_trainer_config(tiny[0].model.hf_checkpoint, **overrides)


def test_bad_lora_targets_fail_at_init(tiny):
    overrides = dict(use_lora=True, lora_target_modules=["no_such_layer"])
    trainer = DiffusionTrainer(tiny_trainer_config(tiny[0].model.hf_checkpoint, **overrides), tiny[1])
    with pytest.raises(MilesUserError, match="--use-lora"):
        trainer.init()


def test_bad_geometry_errors(tiny):
    with pytest.raises(MilesUserError, match="not divisible by --num-steps-per-rollout 3"):
        make_trainer(tiny, num_steps_per_rollout=3).train(0, tiny[3])
    with pytest.raises(MilesUserError, match="--micro-batch-size 3 must divide"):
        make_trainer(tiny, micro_batch_size=3).train(0, tiny[3])
    with pytest.raises(MilesUserError, match="not divisible by --dp-replicate-size"):
        ParallelDims.from_config(replace(trainer_config().trainer, dp_replicate_size=3), 4)
    with pytest.raises(MilesUserError, match="--ulysses-degree 3 must divide"):
        ParallelDims.from_config(replace(trainer_config().trainer, sequence_parallel_size=4, ulysses_degree_resolved=3), 4)
    dims = ParallelDims.from_config(trainer_config(dp_replicate_size=2, sequence_parallel_size=2).trainer, 8)
    assert (dims.dp_shard, dims.dp_size, dims.ring, dims.ulysses) == (2, 4, 1, 2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sequence_parallel_without_a_family_plan_is_a_clear_error(tiny):
    from miles.backends.fsdp_utils.parallelize import apply_sequence_parallel

    args, family, pipe, _ = tiny
    dims = ParallelDims(world_size=2, sp=2, ulysses=2)
    with pytest.raises(MilesUserError, match="no context-parallel plan"):
        apply_sequence_parallel(pipe.transformer, family, dims, mesh=None, name="transformer")


def test_gradient_checkpointing_attention_backend_and_offload_keep_the_gradients(tiny):
    samples = tiny[3]
    reference = make_trainer(tiny, lr=0.0, clip_grad=0.0, micro_batch_size=4)
    reference.train(0, samples)
    for options in (
        dict(gradient_checkpointing=True),
        dict(fsdp_attention_backend="native"),
        dict(fsdp_cpu_offload=True),
    ):
        trainer = make_trainer(tiny, lr=0.0, clip_grad=0.0, micro_batch_size=4, **options)
        trainer.train(0, samples)
        for name, grad in grads(reference).items():
            torch.testing.assert_close(grads(trainer)[name], grad, rtol=1e-5, atol=1e-8, msg=lambda m: f"{options}: {m}")
    with pytest.raises(MilesUserError, match="--fsdp-attention-backend 'no_such_backend'"):
        make_trainer(tiny, fsdp_attention_backend="no_such_backend")


def test_optimizer_state_is_counted_once_the_first_step_creates_it(tiny):
    """What optimizer parking reads after the first training (each rank's shard of the sharded moments)."""
    trainer = make_trainer(tiny, use_lora=True, micro_batch_size=4)
    assert optimizer_state_bytes(trainer.optimizer, "cpu") == 0  # AdamW creates its moments in the first step
    trainer.train(0, tiny[3])
    moments = sum(2 * p.to_local().numel() * p.to_local().element_size() for _, p in trainer.trainable)
    assert optimizer_state_bytes(trainer.optimizer, "cpu") == moments
    assert trainer.optimizer_parking.next_peak_extra == 0  # measured on GPUs only


def test_fp16_forward_uses_the_grad_scaler(tiny):
    trainer = make_trainer(tiny, diffusion_forward_dtype="fp16", use_lora=True, micro_batch_size=4)
    assert trainer.scaler.is_enabled()
    metrics = trainer.train(0, tiny[3])
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["train/grad_norm"]])).all()
    assert trainer.global_step == 1


@pytest.mark.parametrize("init", ["true", "pissa"])
def test_a_lora_base_loaded_in_the_forward_dtype_builds_the_trainer_a_master_dtype_load_builds(tiny, monkeypatch, init):
    """`base_load_dtype`: the base held whole in bf16 is loaded in bf16 (in fp32 for PiSSA, which decomposes it);
    every parameter and buffer (the adapters, created in fp32 by `adapters_created_in`, PiSSA's rewritten base) is
    bitwise what an fp32 load gives."""
    from miles.backends.fsdp_utils import actor

    def state(trainer):
        tensors = {**dict(trainer.model.named_parameters()), **dict(trainer.model.named_buffers())}
        return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in tensors.items()}

    options = dict(use_lora=True, diffusion_forward_dtype="bf16", lora_init_weights=init)
    loaded_in_bf16 = state(make_trainer(tiny, **options))
    monkeypatch.setattr(actor, "base_load_dtype", lambda trainer, dims: torch.float32)
    loaded_in_fp32 = state(make_trainer(tiny, **options))
    assert loaded_in_bf16.keys() == loaded_in_fp32.keys()
    assert any("lora_A" in name and t.dtype == torch.float32 for name, t in loaded_in_bf16.items())
    for name, tensor in loaded_in_fp32.items():
        assert loaded_in_bf16[name].dtype == tensor.dtype and torch.equal(loaded_in_bf16[name], tensor), name


def test_lora_base_is_held_whole_in_the_forward_dtype_and_trains_identically(tiny, monkeypatch):
    """On one rank the frozen base weights stay out of FSDP, whole and in bf16 (frozen_params_kept_whole); a
    LoRA step gives bitwise the loss and adapter gradients of FSDP casting fp32 master copies for each forward."""
    from torch.distributed.tensor import DTensor

    from miles.backends.fsdp_utils import parallelize

    options = dict(use_lora=True, diffusion_forward_dtype="bf16", lr=0.0, clip_grad=0.0, micro_batch_size=4)
    held_whole = make_trainer(tiny, **options)
    frozen = [p for p in held_whole.model.parameters() if not p.requires_grad]
    assert frozen and all(type(p) is not DTensor and p.dtype == torch.bfloat16 for p in frozen)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for _, p in held_whole.trainable)
    monkeypatch.setattr(parallelize, "frozen_params_kept_whole", lambda *args: set())
    sharded = make_trainer(tiny, **options)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in sharded.model.parameters())

    metrics = {name: trainer.train(0, tiny[3]) for name, trainer in (("whole", held_whole), ("sharded", sharded))}
    assert metrics["whole"]["train/loss"] == metrics["sharded"]["train/loss"]
    expected = grads(sharded)
    assert all(torch.equal(grad, expected[name]) for name, grad in grads(held_whole).items())
    assert any(grad.abs().sum() > 0 for grad in expected.values())


@pytest.mark.parametrize("forward_dtype", ["fp32", "bf16"])
def test_blocks_sharded_in_groups_take_the_same_gradients(tiny, forward_dtype):
    """--fsdp-blocks-per-unit 2: fewer FSDP units, each block's gradient bit for bit the same. The embeddings
    every block reads (the root's timestep and text embedders) sum their blocks' contributions in another order
    (FSDP's autograd nodes around each unit's inputs differ), so theirs agree to rounding only."""
    from torch.distributed.fsdp import FSDPModule

    runs = {}
    for per_unit in (1, 2):
        trainer = make_trainer(tiny, fsdp_blocks_per_unit=per_unit, use_lora=False, micro_batch_size=2, lr=0.0,
                               clip_grad=0.0, diffusion_forward_dtype=forward_dtype)
        loss = trainer.train(0, tiny[3])["train/loss"]
        units = {id(unit._get_fsdp_state()) for module in trainer.model.values() for unit in module.modules()
                 if isinstance(unit, FSDPModule)}
        runs[per_unit] = loss, grads(trainer), len(units)
    (loss, reference, units), (grouped_loss, got, grouped_units) = runs[1], runs[2]
    assert grouped_loss == loss and grouped_units < units
    assert max(float(g.abs().max()) for g in reference.values()) > 0
    for name in reference:
        if ".transformer_blocks." in name:
            assert torch.equal(got[name], reference[name]), name
        else:  # summed in the forward dtype: rounding at its precision, relative to the gradient's scale
            scale = float(reference[name].abs().max())
            torch.testing.assert_close(got[name], reference[name], rtol=0,
                                       atol=(2**-5 if forward_dtype == "bf16" else 1e-6) * scale)


@pytest.mark.parametrize("use_lora, forward_dtype", [(False, "fp32"), (False, "bf16"), (True, "bf16")])
def test_one_rank_reduces_once_per_window_with_the_same_gradients(tiny, monkeypatch, use_lora, forward_dtype):
    """On one rank under LoRA, FSDP reduces a window's gradients after its last micro-batch only (the others
    accumulate in the reduce dtype): the gradients and the stepped weights are those of a reduction after every
    micro-batch, bit for bit. (A full fine-tune keeps the reduction per micro-batch, for memory; the equality is
    checked for its gradients as well.)"""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    reductions, reduce = [0], param_group.foreach_reduce  # one call per FSDP unit and reduction

    def counted_reduce(*args, **kwargs):
        reductions[0] += 1
        return reduce(*args, **kwargs)

    monkeypatch.setattr(param_group, "foreach_reduce", counted_reduce)
    runs = []
    for once in (True, False):
        trainer = make_trainer(tiny, use_lora=use_lora, micro_batch_size=2, diffusion_forward_dtype=forward_dtype)
        assert trainer.reduce_once_per_window == use_lora  # a full fine-tune keeps the reduction per micro-batch
        trainer.reduce_once_per_window = once  # its equality holds all the same
        reductions[0] = 0
        trainer.train(0, tiny[3])
        runs.append((grads(trainer), {n: p.full_tensor().clone() for n, p in trainer.trainable}, reductions[0]))
    (grads_once, weights_once, reduced_once), (grads_each, weights_each, reduced_each) = runs
    assert reduced_each == 4 * reduced_once > 0  # 8 pairs in micro-batches of 2: one window of 4
    assert max(float(g.abs().max()) for g in grads_each.values()) > 0
    for name in grads_each:
        assert torch.equal(grads_once[name], grads_each[name]), name
        assert torch.equal(weights_once[name], weights_each[name]), name


def test_a_gradient_left_unreduced_by_the_last_micro_batch_is_an_error_not_a_lost_gradient(tiny, monkeypatch):
    """What a unit skipped by a window's last micro-batch would leave: gradients accumulated and never reduced
    (here every unit's, with the last backward's sync kept off too). The step says so instead of stepping."""
    trainer = make_trainer(tiny, use_lora=True, micro_batch_size=2)
    keep_sync_off = trainer._reduce_gradients_after_this_backward
    monkeypatch.setattr(trainer, "_reduce_gradients_after_this_backward", lambda last: keep_sync_off(False))
    with pytest.raises(RuntimeError, match="left its gradient unreduced"):
        trainer.train(0, tiny[3])
