"""The target adapter over mlx-lm models: one forward with feature capture, and rollback for every cache kind."""
