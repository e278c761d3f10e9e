"""`mlx-dflash serve`: a local OpenAI-compatible server (FastAPI on uvicorn).

One worker thread owns the loaded model and its prompt store (the engine runs
one generation at a time); HTTP handlers validate a request, put it on a
bounded queue (429 when full) and relay the worker's events, as SSE or as one
JSON body. Every response carries `usage`, llama.cpp-style `timings` and a
`dflash` object. Penalties, logit_bias and a constrained format are logits
processors the DFlash verify applies row by row; logprobs run on the engine's
plain decoding, and `dflash.mode` / `dflash.fallback` say so; fields a request
may carry that change nothing are accepted and ignored, those that would change
the answer and cannot be honoured are a 400 naming them.

    mlx-dflash serve [--model M] [--host H] [--port P] [--api-key-file F]
                     [--cors ORIGIN ...] [--allowed-hosts NAME ...] [--queue-size N]
                     [--grace S] [--quiet]

Modules: errors (OpenAI-format errors), schemas (request bodies), worker (the
generation thread), prompt_ids (a request's prompt as token ids, within the context), catalog (jobs, counters, model names), security (Host /
Origin / content-type / body checks, the API key, the request log), connections
(socket limits), app (the FastAPI app, shared routes), relay (one generation for
a handler, the shared stats), openai_api / responses_api / anthropic_api (the
three APIs), processors (a request's logits processors, logprob entries), cli.
"""

import mlx_dflash  # noqa: F401  (fast BLAS before anything imports mlx)

from .app import create_app
from .catalog import ManagerCatalog
from .cli import add_parser, run
from .errors import APIError
from .worker import Worker

__all__ = ["create_app", "add_parser", "run", "APIError", "ManagerCatalog", "Worker"]
