"""Developer tools that do not ship with the package (tools/embedded: how the embedded models are made)."""
