"""The CLI commands, one module each (app/cli.py dispatches)."""
