"""`mlx-dflash bench`: side-by-side speed against mlx-lm, its modes and reports."""
