"""Defaults shared by the command line (miles/config) and the engine, which must not import the config package;
torch-free, so that parsing a command line stays fast."""

DEFAULT_NOISE_LEVEL = 0.7  # η of docs/algorithms.md §2 unless the user says otherwise (--diffusion-noise-level, engine requests)
