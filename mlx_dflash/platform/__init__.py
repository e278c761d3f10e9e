"""The machine: the fast BLAS on Linux, the Hugging Face hub, and where files live."""
