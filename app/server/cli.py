"""`mlx-dflash serve`: arguments, the API key, start-up and shutdown."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from mlx_dflash.engine.distributed import world
from mlx_dflash.platform.paths import cache_dir
from mlx_dflash.settings.schema import SettingsError, check_global, check_type
from mlx_dflash.settings.store import remove_stale_temps

from .app import create_app
from .catalog import ManagerCatalog
from .connections import HEAD_TIMEOUT_S, KEEP_ALIVE_S, MAX_HEAD_BYTES, with_head_timeout
from .errors import error_line
from .split import SplitServer

KEY_ENV = "MLX_DFLASH_API_KEY"
CALIBRATION_TEMP = re.compile(r"^.+\.\d+\.tmp$")  # calibrate._write's NAME.PID.tmp


def add_parser(sub):
    p = sub.add_parser("serve", help="run a local OpenAI-compatible server")
    p.add_argument("--model", default=None,
                   help="The model to load at start and answer with by default: an id from `mlx-dflash models list`, or a "
                        "folder (default: the default model).")
    p.add_argument("--host", default=None, help="The address to listen on (default from settings: 127.0.0.1).")
    p.add_argument("--port", type=int, default=None, help="The port to listen on (default from settings: 8000).")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help=f"Require the API key on the first line of FILE, sent as 'Authorization: Bearer KEY' or "
                        f"'x-api-key: KEY' (default: ${KEY_ENV}, else the api_key setting, else no key).")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: it would show in `ps`
    p.add_argument("--cors", nargs="+", default=None, metavar="ORIGIN",
                   help="Web pages (origins such as http://localhost:3000) that may call the server from a "
                        "browser; '*' allows any (default from settings: none).")
    p.add_argument("--allowed-hosts", nargs="+", default=(), metavar="NAME",
                   help="Other names clients may reach the server by, as their Host header says ('*.example.org' "
                        "for a domain, '*' for any). IP addresses, localhost and this machine's name always work.")
    p.add_argument("--queue-size", type=int, default=8, help="How many requests may wait for the worker; past that, a request is answered 429 "
                        "(default 8).")
    p.add_argument("--max-batch", default=None, metavar="auto|N",
                   help="How many requests are decoded together, with DFlash in the batch: 1..64 (1: one at a time), "
                        "or auto: the largest size that still pays on this machine, measured once per model "
                        "(default from settings: auto).")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="On Ctrl-C, how long running generations may go on before they are stopped (default 10).")
    p.add_argument("--strict-models", action="store_true",
                   help="Answer 404 to a request that names a model this server does not have. Without it, such a "
                        "request (a client's own default name, say) is answered by the default model.")
    p.add_argument("--header-timeout", type=float, default=HEAD_TIMEOUT_S, metavar="SECONDS",
                   help=f"Close a connection whose request headers are not complete this long after it opened "
                        f"(default {HEAD_TIMEOUT_S:g}).")
    p.add_argument("--keep-alive", type=float, default=KEEP_ALIVE_S, metavar="SECONDS",
                   help=f"Close a connection that stays idle this long between requests (default {KEEP_ALIVE_S:g}).")
    p.add_argument("--quiet", action="store_true", help="Write no log line per request.")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="How much the HTTP server (uvicorn) itself logs (default warning).")
    p.add_argument("--split", default="auto", choices=("auto", "tensor", "pipeline"),
                   help="Under mlx.launch: how the target is split over the ranks (default auto: tensor "
                        "parallelism where mlx-lm has it for the family, else pipeline). Rank 0 answers the "
                        "requests; the other ranks compute their part of each step.")


def api_key(args, settings_key: Optional[str]) -> Optional[str]:
    """--api-key-file, else $MLX_DFLASH_API_KEY, else the settings' api_key. A key
    on the command line is refused: every user of the machine could read it."""
    if args.api_key is not None:
        raise ValueError(f"--api-key would show the key to anyone who runs `ps`; set {KEY_ENV} "
                         "or use --api-key-file FILE")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the API key file {args.api_key_file} "
                             f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"the API key file {args.api_key_file} is empty")
        return key
    env = os.environ.get(KEY_ENV)
    if env is not None:
        if not env.strip():
            raise ValueError(f"{KEY_ENV} is set but empty; unset it or give it a key")
        return env.strip()
    return settings_key or None


def run(args) -> int:
    import socket

    from mlx_dflash.settings.store import SettingsStore

    store = SettingsStore()
    g = store.globals()
    host = args.host or g.host
    port = args.port if args.port is not None else g.port
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    if args.queue_size < 1:
        raise ValueError(f"--queue-size must be >= 1, got {args.queue_size}")
    max_batch = g.max_batch
    if args.max_batch is not None:
        try:
            max_batch = check_type("max_batch", args.max_batch)
            check_global(replace(g, max_batch=max_batch))
        except SettingsError as e:
            raise ValueError(f"--max-batch: {e}") from None
    if not 0 <= args.grace <= 3600:  # also refuses nan
        raise ValueError(f"--grace must be in 0..3600 seconds, got {args.grace}")
    for flag, v in (("--header-timeout", args.header_timeout), ("--keep-alive", args.keep_alive)):
        if not 0 < v <= 3600:
            raise ValueError(f"{flag} must be in (0, 3600] seconds, got {v:g}")
    key = api_key(args, g.api_key)
    cors = tuple(args.cors if args.cors is not None else g.cors_origins)
    catalog = ManagerCatalog(store)
    model = split = preload = None
    group = world()
    if group is not None:  # started by mlx.launch: the target split over the ranks, rank 0 serves
        split = SplitServer(args.model, store, group, args.split)
        if split.leader is None:
            return split.follow()
        catalog, model = split.catalog, split.lm.id
        if max_batch == "auto":  # a split target is measured and served one request at a time
            max_batch = 1
    elif args.model is not None:  # an id or a model folder; fail now, in one line, if neither
        from mlx_dflash.models.model_names import resolve

        entry = resolve(args.model, store)
        if entry.kind != "target":
            raise ValueError(f"'{entry.id}' is a {entry.kind_label}, not a model to serve; "
                             "pick a target from `mlx-dflash models list`")
        model = entry.id
    else:
        from mlx_dflash.models.model_names import resolve

        try:
            preload = resolve(None, store).id
        except ValueError as e:  # still useful: requests can name any listed model
            sys.stderr.write(f"mlx-dflash: no default model ({error_line(e)}); "
                             "requests must name a model\n")
    try:  # a clear message instead of uvicorn's log line when the port is taken
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    remove_stale_temps(cache_dir() / "calibration", CALIBRATION_TEMP)  # left by a killed writer
    app = create_app(catalog, api_key=key, cors=cors, queue_size=args.queue_size, max_batch=max_batch, model=model,
                     preload=preload,
                     allowed_hosts=(*args.allowed_hosts, host), log=not args.quiet,
                     strict_models=args.strict_models)
    sys.stderr.write(f"mlx-dflash: serving on http://{host}:{port}/v1"
                     f"{' (API key required)' if key else ''}; Ctrl-C stops\n")
    if not key and not _loopback(host):
        sys.stderr.write(f"mlx-dflash: warning: {host} is reachable from other machines and no API key is set "
                         f"(set {KEY_ENV} or use --api-key-file)\n")
    try:
        return _serve(app, host, port, args)
    finally:
        if split is not None:
            split.close()  # the other ranks' follow() returns


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _serve(app, host, port, args) -> int:
    """uvicorn, with our own Ctrl-C handling (uvicorn alone waits for every
    queued and running request): the first stops accepting, answers the queue
    503 and gives running generations `--grace` seconds; a second exits now."""
    import uvicorn

    worker = app.state.worker

    class Server(uvicorn.Server):
        stopped_by: Optional[int] = None

        def handle_exit(self, sig, frame):
            if self.stopped_by is None:
                self.stopped_by = sig
                sys.stderr.write(f"mlx-dflash: stopping; running requests have {args.grace:g} s to finish "
                                 "(Ctrl-C again to stop now)\n")
                worker.close(args.grace)
                super().handle_exit(sig, frame)
                getattr(self, "_captured_signals", []).clear()  # run() gives the exit status, not a re-raise
                return
            # a second signal: stop at once, without running Python's exit (the worker may be
            # inside MLX, which must not be torn down); the requests still open get their log line
            worker.halt()
            app.state.request_log.cut_open("cut by the shutdown: Ctrl-C twice")
            sys.stderr.write("mlx-dflash: stopped\n")
            sys.stderr.flush()
            os._exit(130 if sig == signal.SIGINT else 143)

    config = uvicorn.Config(app, host=host, port=port, log_level=args.log_level, access_log=False,
                            http=with_head_timeout(args.header_timeout), timeout_keep_alive=args.keep_alive,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            timeout_graceful_shutdown=args.grace + 5)  # a backstop: the worker cancels first
    server = Server(config)
    server.run()
    rc = 130 if server.stopped_by == signal.SIGINT else 0
    # (the engine may still be handing back the last cancelled rows, and the prompt store writing them
    # to disk: both inside MLX, where Python's exit would abort the process)
    if not worker.quiesce(args.grace + 5):
        sys.stderr.flush()
        os._exit(rc)
    return rc
