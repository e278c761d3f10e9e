"""`mlx-dflash serve`: arguments and start-up."""

from __future__ import annotations

import sys

from .errors import _line
from .app import create_app
from .worker import ManagerCatalog


def add_parser(sub):
    p = sub.add_parser("serve", help="run a local OpenAI-compatible server")
    p.add_argument("--model", default=None,
                   help="model id (or folder) to load at start and use by default (see `mlx-dflash models list`)")
    p.add_argument("--host", default=None, help="address to listen on (default from settings: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default from settings: 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default from settings: none)")
    p.add_argument("--cors", nargs="+", default=None, metavar="ORIGIN",
                   help="allow browser requests from these origins (default from settings: none)")
    p.add_argument("--queue-size", type=int, default=8, help="requests that may wait for the worker (default 8)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    import socket

    import uvicorn

    from mlx_dflash.settings import SettingsStore

    store = SettingsStore()
    g = store.globals()
    host = args.host or g.host
    port = args.port if args.port is not None else g.port
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if args.queue_size < 1:
        raise ValueError(f"--queue-size must be >= 1, got {args.queue_size}")
    key = args.api_key if args.api_key is not None else g.api_key
    cors = tuple(args.cors if args.cors is not None else g.cors_origins)
    catalog = ManagerCatalog(store)
    model = None
    if args.model is not None:  # an id or a model folder; fail now, in one line, if neither
        from mlx_dflash.manager import resolve

        entry = resolve(args.model, store)
        if entry.kind != "target":
            raise ValueError(f"'{entry.id}' is a {entry.kind_label}, not a model to serve; "
                            "pick a target from `mlx-dflash models list`")
        model = entry.id
    else:
        from mlx_dflash.manager import resolve

        try:
            resolve(None, store)
        except ValueError as e:  # still useful: requests can name any listed model
            sys.stderr.write(f"mlx-dflash: no default model ({_line(e)}); "
                             "requests must name a model\n")
    try:  # a clear message instead of uvicorn's log line when the port is taken
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    app = create_app(catalog, api_key=key, cors=cors, queue_size=args.queue_size, model=model)
    sys.stderr.write(f"mlx-dflash: serving on http://{host}:{port}/v1"
                     f"{' (API key required)' if key else ''}; Ctrl-C stops\n")
    uvicorn.run(app, host=host, port=port, log_level=args.log_level)
    return 0
