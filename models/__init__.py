"""The embedded model pair: a data-only package (`mlx_dflash.models.loader.models_dir`)."""
