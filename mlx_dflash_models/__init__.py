"""The embedded model pair: a data-only package (`mlx_dflash.loader.models_dir`)."""
