"""The embedded model pair, installed as the data-only package `mlx_dflash_models`."""
