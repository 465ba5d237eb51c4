"""LR schedules (docs/algorithms.md §9; invariant §11.19)."""

from __future__ import annotations

import math
from argparse import Namespace

import pytest
import torch

from miles.diffusion.lr_scheduler import LRScheduler, build_lr_scheduler
from miles.utils.errors import MilesUserError

MAX, MIN = 1e-3, 1e-5


def _optimizer(lr: float = 123.0) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _scheduler(style="cosine", warmup=10, decay=100, init=0.0, **kw) -> LRScheduler:
    return LRScheduler(_optimizer(), MAX, MIN, init, warmup, decay, style, **kw)


def test_warmup_is_linear_including_the_endpoint():
    init = 1e-4
    sched = _scheduler("linear", warmup=8, init=init)
    for s in range(9):
        assert sched.get_lr(s) == pytest.approx(init + (MAX - init) * s / 8)
    assert sched.get_lr(8) == pytest.approx(MAX)
    assert _scheduler("linear", warmup=8).get_lr(0) == 0.0, "init 0: the first step runs at lr 0"


def test_cosine_shape():
    sched = _scheduler("cosine", warmup=10, decay=110)
    assert sched.get_lr(10) == pytest.approx(MAX)
    assert sched.get_lr(60) == pytest.approx((MAX + MIN) / 2)
    assert sched.get_lr(110) == pytest.approx(MIN)
    assert sched.get_lr(111) == MIN and sched.get_lr(10_000) == MIN
    r = (35 - 10) / 100
    assert sched.get_lr(35) == pytest.approx(MIN + 0.5 * (1 + math.cos(math.pi * r)) * (MAX - MIN))


def test_linear_and_constant():
    lin = _scheduler("linear", warmup=0, decay=50)
    assert lin.get_lr(0) == pytest.approx(MAX) and lin.get_lr(25) == pytest.approx((MAX + MIN) / 2)
    assert lin.get_lr(50) == pytest.approx(MIN) and lin.get_lr(51) == MIN
    const = _scheduler("constant", warmup=5, decay=50)
    assert const.get_lr(2) == pytest.approx(MAX * 2 / 5)
    assert const.get_lr(5) == const.get_lr(49) == const.get_lr(500) == MAX


def test_inverse_square_root():
    sched = _scheduler("inverse-square-root", warmup=16, decay=1000)
    assert sched.get_lr(16) == pytest.approx(MAX)
    assert sched.get_lr(64) == pytest.approx(MAX * 4 / 8)
    assert sched.get_lr(1001) == MIN
    no_warmup = _scheduler("inverse-square-root", warmup=0, decay=10**6)
    assert no_warmup.get_lr(0) == pytest.approx(MAX) and no_warmup.get_lr(100) == pytest.approx(MAX / 10)
    floor = LRScheduler(_optimizer(), MAX, 4e-4, 0.0, 0, 10**6, "inverse-square-root")
    assert floor.get_lr(100) == 4e-4


@pytest.mark.parametrize(
    "style,coeff",
    [
        ("linear", lambda q: 1 - q),
        ("cosine", lambda q: 0.5 * (1 + math.cos(math.pi * q))),
        ("exponential", lambda q: 2 * 0.5**q - 1),
        ("minus_sqrt", lambda q: 1 - math.sqrt(q)),
    ],
)
def test_wsd(style, coeff):
    sched = _scheduler("WSD", warmup=10, decay=100, wsd_decay_steps=20, wsd_decay_style=style)
    for s in (10, 11, 50, 80):
        assert sched.get_lr(s) == pytest.approx(MAX), "flat until D − Dw"
    for s in (81, 90, 95, 100):
        assert sched.get_lr(s) == pytest.approx(MIN + coeff((s - 80) / 20) * (MAX - MIN))
    assert sched.get_lr(100) == pytest.approx(MIN)
    assert sched.get_lr(101) == MIN


def test_step_sets_the_optimizer_lr():
    optimizer = _optimizer(lr=123.0)
    sched = LRScheduler(optimizer, MAX, MIN, 0.0, 4, 20, "linear")
    assert optimizer.param_groups[0]["lr"] == 0.0, "set at construction"
    for s in range(1, 25):
        lr = sched.step()
        assert sched.num_steps == s and optimizer.param_groups[0]["lr"] == lr == sched.get_lr(s)


def test_state_dict_round_trip_and_override():
    sched = _scheduler("cosine", warmup=5, decay=50)
    for _ in range(17):
        sched.step()
    state = sched.state_dict()
    optimizer = _optimizer()
    resumed = LRScheduler(optimizer, 5e-3, 0.0, 0.0, 0, 10, "constant")
    resumed.load_state_dict(state)
    assert resumed.num_steps == 17 and resumed.get_lr() == sched.get_lr()
    assert optimizer.param_groups[0]["lr"] == sched.get_lr()
    overridden = LRScheduler(_optimizer(), 5e-3, 0.0, 0.0, 0, 100, "constant")
    overridden.load_state_dict(state, use_checkpoint_schedule=False)
    assert overridden.num_steps == 17 and overridden.get_lr() == 5e-3


def _args(**kw) -> Namespace:
    base = dict(
        lr=MAX,
        min_lr=MIN,
        lr_warmup_init=0.0,
        lr_warmup_iters=0,
        lr_warmup_fraction=None,
        lr_decay_iters=None,
        lr_decay_style="cosine",
        lr_wsd_decay_iters=None,
        lr_wsd_decay_style=None,
    )
    base.update(kw)
    return Namespace(**base)


def test_build_from_args():
    sched = build_lr_scheduler(_args(), _optimizer(), total_steps=40)
    assert sched.decay_steps == 40 and sched.warmup_steps == 0
    assert sched.get_lr(40) == pytest.approx(MIN)
    sched = build_lr_scheduler(_args(lr_decay_iters=80, lr_warmup_fraction=0.25, lr_warmup_iters=3), _optimizer(), 40)
    assert sched.decay_steps == 80 and sched.warmup_steps == 20, "fraction of D wins over iters"
    sched = build_lr_scheduler(_args(lr_warmup_iters=4, lr_decay_style="linear"), _optimizer(), 40)
    assert sched.get_lr(4) == pytest.approx(MAX) and sched.get_lr(2) == pytest.approx(MAX / 2)
    wsd = _args(lr_decay_style="WSD", lr_wsd_decay_iters=10, lr_wsd_decay_style="linear")
    sched = build_lr_scheduler(wsd, _optimizer(), 40)
    assert sched.get_lr(30) == pytest.approx(MAX) and sched.get_lr(35) == pytest.approx((MAX + MIN) / 2)


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(lr_decay_style="polynomial"), "--lr-decay-style"),
        (dict(lr_warmup_iters=40), "--lr-warmup-iters"),
        (dict(lr_warmup_fraction=1.0), "--lr-warmup-fraction"),
        (dict(min_lr=1.0), "--min-lr"),
        (dict(min_lr=-1e-6), "--min-lr"),
        (dict(lr_warmup_init=1.0), "--lr-warmup-init"),
        (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
        (dict(lr_decay_style="WSD", lr_wsd_decay_iters=50, lr_wsd_decay_style="linear"), "--lr-wsd-decay-iters"),
        (dict(lr_decay_style="WSD", lr_wsd_decay_iters=5, lr_wsd_decay_style="step"), "--lr-wsd-decay-style"),
    ],
)
def test_invalid_settings_name_the_flag(kw, flag):
    with pytest.raises(MilesUserError, match=flag):
        build_lr_scheduler(_args(**kw), _optimizer(), total_steps=40)


def test_zero_total_steps_is_rejected():
    with pytest.raises(MilesUserError, match="--lr-decay-iters"):
        build_lr_scheduler(_args(), _optimizer(), total_steps=0)
