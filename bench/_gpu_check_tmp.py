import torch
from miles.backends.fsdp_utils.spawn import init_distributed, free_port
init_distributed(0, 1, "nccl", free_port())
from miles.testing.make_tiny import build_tiny_pipeline
from miles.backends.fsdp_utils.tiny_rollout import tiny_trainer_args, load_tiny_family, make_rollout_samples
from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.weight_export import iter_sync_tensors
p = build_tiny_pipeline("sd3", "/tmp/tsd3")
for fwd in ("bf16", "fp16", "fp32"):
    a = tiny_trainer_args(p, use_lora=True, use_ema=True, ema_rollout_policy="ema", diffusion_kl_beta=0.01, micro_batch_size=4, diffusion_forward_dtype=fwd, num_rollout=3, diffusion_debug_mode=True)
    f, pipe = load_tiny_family(a)
    s = make_rollout_samples(f, pipe, a, ["a", "b"], 2, [1, 2], seed=1, debug=True)
    t = DiffusionTrainer(a, f, device="cuda"); t.init()
    m = t.train(0, s)
    print(fwd, {k: round(v, 6) for k, v in m.items() if k in ("train/loss", "train/grad_norm", "train/rollout_train_log_prob_abs_diff", "train/model_output_max_abs_diff", "train/kl_loss", "perf/mfu")})
    m0 = torch.cuda.memory_allocated(); t.offload(); m1 = torch.cuda.memory_allocated(); t.onload(); m2 = torch.cuda.memory_allocated()
    print("mem", m0, m1, m2)
    m = t.train(1, s); print("after onload", round(m["train/loss"], 6), round(m["train/kl_loss"], 8), t.global_step)
    print("sync tensors", len(list(iter_sync_tensors(t))))
