"""Settings: the per-model and global fields (schema) and the file that stores them."""
