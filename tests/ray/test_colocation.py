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
    assert not turns.trainer_offloads and not turns.engines_release
    turns.decide([memory(0, 50, 50)], [memory(0, 20, 45)])  # decided once, for the whole run
    assert turns.resident


def test_auto_policy_keeps_turns_when_memory_is_short():
    turns = ColocationPolicy("auto", offload_train=True, offload_rollout=True, margin_gb=8)
    turns.decide([memory(10, 120, 120)], [memory(10, 20, 45)])
    assert turns.decided and not turns.resident and turns.trainer_offloads and turns.engines_release


def test_always_policy_and_no_offload_need_no_decision():
    always = ColocationPolicy("always", offload_train=True, offload_rollout=True, margin_gb=8)
    assert always.decided and always.trainer_offloads and always.engines_release
    apart = ColocationPolicy("auto", offload_train=False, offload_rollout=False, margin_gb=8)
    assert apart.decided and not apart.trainer_offloads and not apart.engines_release
    with pytest.raises(ValueError, match="sometimes"):
        ColocationPolicy("sometimes", offload_train=True, offload_rollout=True, margin_gb=8)
