"""The verify modes' names: what a setting, a flag or a request may ask for.
Free of mlx, so that reading settings stays cheap; registry.py maps each name
to the policy that runs it (and refuses to import when the two disagree)."""

VERIFY_MODES = ("dflash", "adaptive", "lookup", "off")
