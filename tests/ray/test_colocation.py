"""ColocationPolicy: when trainer and engines must keep taking turns on a shared GPU."""

from __future__ import annotations

import pytest

from miles.ray.colocation import GIB, ColocationPolicy, fits_resident
from miles.utils.device_memory import DeviceMemory


def memory(free_gib: float, reserved_gib: float, peak_gib: float, total_gib: float = 141.0) -> DeviceMemory:
    return DeviceMemory(int(free_gib * GIB), int(total_gib * GIB), int(reserved_gib * GIB), int(peak_gib * GIB))


def test_engine_growth_must_fit_beside_the_resident_trainer():
    trainer = memory(free_gib=60, reserved_gib=50, peak_gib=50)
    # the engine holds 20 GiB of weights now and needed 45 at its generation peak: it will grow by 25
    assert fits_resident([trainer], [memory(60, 20, 45)], margin_bytes=8 * GIB)
    assert not fits_resident([trainer], [memory(60, 20, 75)], margin_bytes=8 * GIB)  # 60 - 55 < 8
    assert not fits_resident([trainer], [memory(60, 20, 45)], margin_bytes=40 * GIB)  # 60 - 25 < 40


def test_the_trainer_growing_back_to_its_peak_counts_too():
    engine = memory(60, 20, 25)  # grows by 5 while generating
    assert fits_resident([memory(free_gib=30, reserved_gib=50, peak_gib=50)], [engine], margin_bytes=8 * GIB)
    # the same device, but the trainer's cache was emptied below its training peak: it will take 30 GiB back
    assert not fits_resident([memory(free_gib=30, reserved_gib=40, peak_gib=70)], [engine], margin_bytes=8 * GIB)
    assert fits_resident([memory(free_gib=30, reserved_gib=40, peak_gib=45)], [engine], margin_bytes=8 * GIB)


def test_every_gpu_must_fit_and_no_measurement_means_no():
    engines = [memory(60, 20, 30), memory(60, 20, 45)]
    assert fits_resident([memory(60, 50, 50), memory(40, 50, 50)], engines, margin_bytes=10 * GIB)
    assert not fits_resident([memory(60, 50, 50), memory(30, 50, 50)], engines, margin_bytes=10 * GIB)
    assert not fits_resident([], engines, margin_bytes=0)  # a CPU run reports nothing: keep taking turns
    assert not fits_resident([memory(60, 50, 50)], [], margin_bytes=0)


def test_auto_policy_takes_turns_until_it_has_measured():
    turns = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    assert turns.trainer_offloads and turns.engines_release and not turns.decided
    turns.decide([memory(60, 50, 50)], [memory(60, 20, 45)])
    assert turns.decided and turns.resident
    assert not turns.trainer_offloads and not turns.engines_release and not turns.trainer_empties_cache
    turns.decide([memory(0, 50, 50)], [memory(0, 20, 45)])  # decided once, for the whole run
    assert turns.resident


def test_auto_policy_keeps_turns_when_memory_is_short():
    turns = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    turns.decide([memory(10, 120, 120)], [memory(10, 20, 45)])
    assert turns.decided and not turns.resident and turns.trainer_offloads and turns.engines_release
    assert not turns.trainer_empties_cache


def test_a_trainer_whose_peak_fills_the_gpu_stays_while_only_the_engines_release():
    """The H100 full fine-tune: at rest the trainer holds 46 GiB of weights, gradients and optimizer state, in
    training 70; the engine 7 idle, 10 generating, on 79 GiB. Both peaks do not fit; the engine's beside the
    resting trainer does, so only the engine's few GB move each iteration."""
    trainer, engine = memory(free_gib=25, reserved_gib=46, peak_gib=70, total_gib=79), memory(25, 7, 10, 79)
    turns = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    turns.decide([trainer], [engine])
    assert not turns.resident and not turns.trainer_offloads
    assert turns.engines_release and turns.trainer_empties_cache
    # without the engines' release the trainer could not train beside them: the middle way is not open
    no_release = ColocationPolicy("auto", offload_train=True, offload_rollout=False, margin_gb=8)
    no_release.decide([trainer], [engine])
    assert no_release.trainer_offloads and not no_release.trainer_empties_cache
    # an engine that grows past what the resting trainer leaves keeps the full turns
    short = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    short.decide([trainer], [memory(25, 7, 30, 79)])
    assert short.trainer_offloads and short.engines_release and not short.trainer_empties_cache


def test_always_policy_and_no_offload_need_no_decision():
    always = ColocationPolicy("always", offload_train=True, offload_rollout=True, margin_gb=8)
    assert always.decided and always.trainer_offloads and always.engines_release
    apart = ColocationPolicy("auto", offload_train=False, offload_rollout=False, margin_gb=8)
    assert apart.decided and not apart.trainer_offloads and not apart.engines_release
    with pytest.raises(ValueError, match="sometimes"):
        ColocationPolicy("sometimes", offload_train=True, offload_rollout=True, margin_gb=8)


def test_parking_the_optimizer_state_keeps_both_resident_where_nothing_cheaper_is_known():
    """The H100 full fine-tune with its moments counted: a 71.2 GiB next peak of which 9.7 could be parked, the
    engine growing by 2 GiB, 8 to spare: parking 2.2 GiB more keeps both resident."""
    trainer = DeviceMemory(free=int(45 * GIB), total=int(79 * GIB), reserved=int(34 * GIB),
                           peak_reserved=int(71.2 * GIB), parkable=int(9.7 * GIB))
    engine = memory(45, 4.5, 6.5, 79)
    parks = pytest.approx((8 - (45 - 2 - 37.2)) * GIB, abs=1 << 20)
    # auto: the engines' release (measured) before the parking (not yet measured against it)
    auto = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    auto.decide([trainer], [engine])
    assert not auto.resident and auto.trainer_empties_cache and auto.trainer_parks == 0
    # park: the parking first
    park = ColocationPolicy("park", offload_train=True, offload_rollout=True, margin_gb=8)
    park.decide([trainer], [engine])
    assert park.resident and not park.trainer_offloads and not park.engines_release and park.trainer_parks == parks
    # engines that may not release (no --offload-rollout): auto parks rather than taking full turns
    no_release = ColocationPolicy("auto", offload_train=True, offload_rollout=False, margin_gb=8)
    no_release.decide([trainer], [engine])
    assert no_release.resident and no_release.trainer_parks == parks
    # more than it can park: the middle way, or the full turns
    little = DeviceMemory(trainer.free, trainer.total, trainer.reserved, trainer.peak_reserved, parkable=int(1 * GIB))
    short = ColocationPolicy("park", offload_train=True, offload_rollout=True, margin_gb=8)
    short.decide([little], [engine])
    assert not short.resident and short.trainer_parks == 0 and short.trainer_empties_cache
    short = ColocationPolicy("park", offload_train=True, offload_rollout=False, margin_gb=8)
    short.decide([little], [engine])
    assert short.trainer_offloads and short.trainer_parks == 0
