"""The error a user caused (a bad flag, a model that is not there): every
command prints it as one line, `mlx-dflash CMD: error: ...`, never a traceback."""


class UserError(Exception):
    """An error the user caused; printed as one line, no traceback."""
