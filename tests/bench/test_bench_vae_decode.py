"""bench/bench_vae_decode.py: SD3.5-Medium's VAE decoder timed per layout and chunk, with the floor beside it and how
far each row's pixels are from the first's."""

import sys

import pytest


@pytest.fixture(scope="module")
def bench_vae_decode(bench_script):
    with bench_script("bench_vae_decode") as module:
        yield module


def test_each_layout_and_chunk_gets_a_row_of_the_same_pixels_to_rounding(bench_vae_decode, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_vae_decode.py", "--device", "cpu", "--latent-size", "4", "--images", "2",
                                      "--chunks", "1,2", "--layers", "1", "--modes", "eager", "--repeats", "1"])
    bench_vae_decode.main()
    lines = capsys.readouterr().out.splitlines()
    assert "2 images from 4² latents" in lines[0]
    assert next(line for line in lines if line.startswith("floor: the decoder's"))
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| eager |")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("contiguous", "1"), ("contiguous", "2"), ("channels_last", "1"), ("channels_last", "2")]
    assert rows[0][6].strip() == "0, 0.00%"  # the first row against itself
    assert all(int(r[6].split(",")[0]) <= 2 for r in rows)  # fp32 on the CPU: an 8-bit pixel apart at most
