"""mlx-dflash applications: CLI, chat UI, server. Imports mlx_dflash, never the reverse."""
