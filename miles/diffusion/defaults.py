"""The math core's default values, torch-free so that the command line can declare them without importing torch."""

DEFAULT_NOISE_LEVEL = 0.7  # η of docs/algorithms.md §2 unless the user says otherwise (--diffusion-noise-level, engine requests)
