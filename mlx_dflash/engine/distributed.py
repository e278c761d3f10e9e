"""DFlash on a target split across processes or machines (`mx.distributed`,
started by `mlx.launch`): the target sharded by mlx-lm's own tensor-parallel
`model.shard(group)` or pipeline `model.model.pipeline(group)`, the drafter
replicated on every rank (a draft needs no communication).

Every rank runs the same decode session on the same inputs, so every decision
is taken identically everywhere without a collective of its own:
- logits: tensor parallelism all-reduces inside every layer and pipeline
  parallelism all-gathers the last stage's hidden state, so every rank holds
  the same logits and acceptance (greedy, or sampled from the same seed) is the
  same computation on the same numbers;
- features: under tensor parallelism the tapped layers' outputs are complete on
  every rank (after the layer's all-reduce); under pipeline parallelism a rank
  holds only its own layers, so each rank writes its taps into a zero buffer and
  one all_sum per target forward gives every rank all of them (ordered after the
  forward's own collectives and scheduled at once, so every rank runs every
  collective in the same order);
- costs: the guard's calibration runs on all ranks together (a fixed number of
  rounds: a rank that stopped early would leave the others waiting) and rank
  0's numbers are broadcast; the collectives are inside the timed forwards, so
  the guard weighs communication like any other cost;
- sampling: `Split` seeds every rank's generator with rank 0's seed once;
- time: a step's wall-clock time differs by rank, so a split target's steps
  report none (`ShardedTarget.clocked`): the guard's prices as paid stay as
  measured, the same on every rank.
Verify mode `adaptive` reads each rank's own wall-clock times every cycle, so
it is refused here (the guard chooses from the shared costs instead).

Rank 0 alone prints, serves or draws; `Channel` carries its requests to the
others. A rank that dies surfaces on the others as the backend's error (ring:
"connection to a peer was lost"); `lost_rank` words it as one line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx_lm

from ..cache.prompt_cache import PromptCache
from ..drafting.drafter import load_drafter, validate
from ..policy.costs import COST_CONTEXT, Costs, need
from ..target.adapter import Target, TargetError, forget
from .calibrate import Calibration, measure_costs
from .decode_config import DecodeConfig
from .decoder import Decoder
from .stats import GenerationResponse

TENSOR, PIPELINE = "tensor", "pipeline"
SPLITS = ("auto", TENSOR, PIPELINE)
CALIBRATION_ROUNDS = 7  # fixed on every rank (a time budget would end on different rounds)


class DistributedError(RuntimeError):
    """A split this run cannot use, or a lost rank (the reason is in the message)."""


def world():
    """The group `mlx.launch` started this process in, or None when it runs alone."""
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def supported(model) -> tuple:
    """The split kinds mlx-lm implements for this model."""
    out = []
    if hasattr(model, "shard"):
        out.append(TENSOR)
    if hasattr(getattr(model, "model", None), "pipeline"):
        out.append(PIPELINE)
    return tuple(out)


@dataclass
class Split:
    """How the target is split and where this rank sits in it."""

    group: object
    mode: str  # tensor | pipeline
    num_layers: int  # the whole target's decoder layers
    start: int = 0  # this rank's layers [start, end) (pipeline; tensor: all)
    end: int = 0

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def info(self) -> dict:
        return {"ranks": self.size, "split": self.mode, "layers": [self.start, self.end]}


def split_model(model, group, mode: str = "auto", seed: Optional[int] = None) -> Split:
    """Shard a (lazily loaded) mlx-lm model over `group` in place: `mode` tensor,
    pipeline or auto (tensor where the family has it, else pipeline). Every
    rank's generator is seeded with rank 0's `seed` (a random one if None) so
    unseeded sampling draws the same numbers everywhere."""
    if mode not in SPLITS:
        raise DistributedError(f"unknown split '{mode}'; valid: {', '.join(SPLITS)}")
    kinds = supported(model)
    name = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if not kinds:
        raise DistributedError(f"mlx-lm cannot split model type '{name}' (no tensor or pipeline parallelism)")
    why = _tensor_problem(model, group.size()) if TENSOR in kinds else None
    if mode == "auto":
        mode = PIPELINE if why and PIPELINE in kinds else kinds[0]
    if mode == TENSOR and why:
        raise DistributedError(f"cannot split '{name}' tensor-parallel over {group.size()} ranks: {why}"
                               + ("; use --split pipeline" if PIPELINE in kinds else ""))
    if mode not in kinds:
        raise DistributedError(f"mlx-lm has no {mode} parallelism for model type '{name}'; "
                               f"use --split {kinds[0]}")
    n = len(model.layers)
    if mode == TENSOR:
        model.shard(group)
        split = Split(group, TENSOR, n, 0, n)
    else:
        model.model.pipeline(group)
        split = Split(group, PIPELINE, n, model.model.start_idx, model.model.end_idx)
    forget(model)  # a probe taken before the split names layers this rank may not hold
    shared = broadcast_ints([seed if seed is not None else int.from_bytes(os.urandom(4), "little") >> 1], group)
    mx.random.seed(shared[0])
    return split


def _tensor_problem(model, ranks: int) -> Optional[str]:
    """Why mlx-lm's tensor split would not divide this model evenly, if it would not
    (its shard() divides the head counts without checking)."""
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args
    for f in ("num_attention_heads", "num_key_value_heads"):
        v = args.get(f) if isinstance(args, dict) else getattr(args, f, None)
        if isinstance(v, int) and v % ranks:
            return f"{f} = {v} is not a multiple of {ranks}"
    return None


def load(model_path: str, drafter_path: Optional[str] = None, group=None, mode: str = "auto",
         seed: Optional[int] = None) -> tuple:
    """Load this rank's part of the target (mlx-lm, lazily: only the weights of
    this rank's shard are read) and the whole drafter (replicated). The target
    keeps its checkpoint dtype on every rank (a dtype chosen by timing one rank
    could differ between machines). Returns (model, tokenizer, drafter or None, Split)."""
    group = group or world()
    if group is None:
        raise DistributedError("no distributed group: start every rank with mlx.launch")
    try:
        model, tok = mlx_lm.load(model_path, lazy=True)
    except ValueError as e:
        raise DistributedError(f"mlx-lm cannot load {model_path}: {str(e).splitlines()[0]}") from None
    split = split_model(model, group, mode, seed)
    mx.eval(model.parameters())
    drafter = None
    if drafter_path is not None:
        drafter = load_drafter(drafter_path)
        validate(drafter, ShardedTarget(model, split))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank loaded
    return model, tok, drafter, split


# -- collectives --------------------------------------------------------------------------
def broadcast_ints(values: Sequence[int], group) -> List[int]:
    """Rank 0's integers on every rank (the others pass as many placeholders)."""
    x = mx.array(list(values), mx.int32) if group.rank() == 0 else mx.zeros((len(values),), mx.int32)
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu).tolist()


def broadcast_floats(values: Sequence[float], group) -> List[float]:
    x = mx.array(list(values), mx.float32) if group.rank() == 0 else mx.zeros((len(values),), mx.float32)
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu).tolist()


class Channel:
    """Rank 0's messages (JSON values) to every rank: two all_sums each (the
    length, then the bytes), so the others learn what rank 0 is about to run."""

    def __init__(self, group):
        self.group = group

    def share(self, obj=None):
        """On rank 0: send `obj` and return it; elsewhere: return rank 0's."""
        lead = self.group.rank() == 0
        data = json.dumps(obj).encode() if lead else b""
        n = broadcast_ints([len(data)], self.group)[0]
        buf = mx.array(list(data), mx.int32) if lead else mx.zeros((n,), mx.int32)
        got = mx.distributed.all_sum(buf, group=self.group, stream=mx.cpu).tolist()
        return obj if lead else json.loads(bytes(got).decode())


def lost_rank(e: BaseException, group=None) -> Optional[str]:
    """One line for an error that means another rank has gone, else None."""
    msg = str(e).splitlines()[0] if str(e) else ""
    if not isinstance(e, RuntimeError) or not any(k in msg.lower() for k in (
            "[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer", "connection", "socket")):
        return None
    who = f"rank {group.rank()}: " if group is not None else ""
    return (f"{who}lost contact with another rank ({msg}); every rank must run until the end "
            "(check the other machines' output, then start mlx.launch again)")


# -- the target -----------------------------------------------------------------------------
@dataclass
class CommCost:
    """Measured time of one all_sum of [1, L, H] rows in the model's dtype on
    this group (seconds by L), and the collectives one target forward runs."""

    per_op: Dict[int, float] = field(default_factory=dict)
    ops_per_forward: int = 0  # tensor: 2 per layer; pipeline: one hand-over per stage boundary + the gather
    feature_ops: int = 0  # pipeline: the all_sum carrying the drafter's taps (when it taps)

    def at(self, L: int) -> float:
        if not self.per_op:
            return 0.0
        ks = sorted(self.per_op)
        lo = max([k for k in ks if k <= L], default=ks[0])
        hi = min([k for k in ks if k >= L], default=ks[-1])
        if lo == hi:
            return self.per_op[lo]
        return self.per_op[lo] + (self.per_op[hi] - self.per_op[lo]) * (L - lo) / (hi - lo)


class ShardedTarget(Target):
    """The target adapter on one rank of a split model: the drafter names the
    whole target's layers; under pipeline parallelism this rank captures the
    ones it holds and one all_sum hands every rank all of them. Counts the
    collectives its forwards ran, for the stats. Its steps report no time
    (`clocked`): each rank's clock differs, and a price raised by one rank's
    would part the ranks' decisions."""

    clocked = False

    def __init__(self, model, split: Split, comm: Optional[CommCost] = None):
        super().__init__(model)
        if split.mode == PIPELINE and self.num_layers != split.end - split.start:
            raise TargetError(f"rank {split.rank} holds {self.num_layers} layers, expected "
                              f"{split.end - split.start} (layers {split.start}..{split.end - 1})")
        self.split = split
        self.local_layers = self.num_layers
        self.num_layers = split.num_layers  # what capture lists and drafter checks index
        self.comm = comm or CommCost()
        self.dtype = self.embed_tokens(mx.array([[0]])).dtype  # (shape inference only)
        self.forwards: List[int] = []  # rows of each forward since the last `take`
        self.feature_forwards: List[int] = []  # rows x taps of each features all_sum

    def __call__(self, tokens: mx.array, cache: list, capture: Sequence[int] = ()):
        capture = self.checked_capture(capture)
        L = tokens.shape[1]
        self.forwards.append(L)
        s = self.split
        if s.mode != PIPELINE or not capture:
            return super().__call__(tokens, cache, capture)
        mine = sorted({i - s.start for i in capture if s.holds(i)})
        logits, f = super().__call__(tokens, cache, mine)
        H = self.hidden_size
        parts = []
        for i in capture:
            if s.holds(i):
                k = mine.index(i - s.start)
                parts.append(f[..., k * H:(k + 1) * H].astype(self.dtype))
            else:
                parts.append(mx.zeros((tokens.shape[0], L, H), self.dtype))
        buf = mx.depends(mx.concatenate(parts, axis=-1), logits)  # after the forward's own collectives
        self.feature_forwards.append(L * len(capture))
        feats = mx.distributed.all_sum(buf, group=s.group)
        # Scheduled now, in program order on every rank: a stage's hand-over (recv) depends on
        # no array, so inside a later graph it could run before this all_sum on one rank and
        # after it on another (a deadlock). Nothing is read back here.
        mx.async_eval(feats)
        return logits, feats

    def take(self) -> tuple:
        """(forwards' rows, forwards that carried features) since the last take."""
        out = (self.forwards, self.feature_forwards)
        self.forwards, self.feature_forwards = [], []
        return out


def forward_ops(split: Split) -> int:
    """Collectives of one target forward (the hidden state's all-reduces or hand-overs)."""
    if split.mode == TENSOR:
        return 2 * split.num_layers  # attention out and MLP down projections
    return split.size  # (size - 1) stage hand-overs + the final all_gather


def measure_comm(split: Split, hidden: int, dtype, widths: Sequence[int] = (1, 5, 8), reps: int = 15) -> CommCost:
    """Time all_sum of [1, L, hidden] on the group, all ranks together (fixed
    reps; the median, after a barrier: a rank arriving late is not counted as
    communication); rank 0's numbers on every rank."""
    per = []
    for L in widths:
        x = mx.ones((1, L, hidden), dtype)
        mx.eval(mx.distributed.all_sum(x, group=split.group))  # warm-up and barrier
        ts = []
        for _ in range(reps):
            x = x * 0.5
            mx.eval(x)
            t = time.perf_counter()
            x = mx.distributed.all_sum(x, group=split.group)
            mx.eval(x)
            ts.append(time.perf_counter() - t)
        per.append(sorted(ts)[len(ts) // 2])
    per = broadcast_floats(per, split.group)
    return CommCost(dict(zip(widths, per)), forward_ops(split), 1 if split.mode == PIPELINE else 0)


# -- the session ----------------------------------------------------------------------------
class DistributedDecoder(Decoder):
    """The decode session on one rank of a split target (decoder.Decoder with
    the split target adapter); stats.distributed says the ranks, the split and
    the time spent in collectives (measured per collective x the collectives run)."""

    def __init__(self, model, tokenizer, drafter=None, config: Optional[DecodeConfig] = None,
                 prompt_cache: Optional[PromptCache] = None, calibration=None, *, split: Split,
                 comm: Optional[CommCost] = None):
        cfg = config or DecodeConfig()
        if cfg.verify_mode == "adaptive":
            raise DistributedError("verify mode 'adaptive' times each rank on its own, so the ranks would "
                                   "choose different widths; use verify mode dflash (the guard) on a split target")
        super().__init__(model, tokenizer, drafter, cfg, prompt_cache, calibration,
                         target=ShardedTarget(model, split, comm))
        self.split = split
        self._t_comm = 0.0
        self._n_ops = 0

    def _book_comm(self, stats) -> None:
        rows, feats = self.target.take()
        c = self.target.comm
        for L in rows:
            self._t_comm += c.ops_per_forward * c.at(L)
            self._n_ops += c.ops_per_forward
        for n in feats:  # the taps' buffer: rows x taps of H
            self._t_comm += c.at(n)
            self._n_ops += 1
        stats.distributed = dict(self.split.info(), collectives=self._n_ops, t_collectives=self._t_comm,
                                 per_collective_s=dict(c.per_op))

    def run(self, prompt) -> Iterator[GenerationResponse]:
        for r in super().run(prompt):
            self._book_comm(r.stats)
            yield r


class DistributedCalibration(Calibration):
    """Costs measured on all ranks together and rank 0's broadcast: every rank's
    guard then takes the same decisions. Held in memory only (a curve cached on
    one machine's disk and not another's would make one rank measure alone)."""

    def __init__(self, split: Split, rounds: int = CALIBRATION_ROUNDS):
        super().__init__()
        self.split, self.rounds = split, rounds
        self.held: Dict[tuple, Costs] = {}

    def costs(self, model, drafter=None, max_width: int = 0, refresh: bool = False, widths: Sequence[int] = (),
              enough: Sequence[int] = (), at: Optional[int] = None, **measure) -> Costs:
        ws = sorted(need(max_width, widths))
        key = (id(model), id(drafter), at)
        got = self.held.get(key)
        if got is not None and not refresh and set(enough or ws) <= set(got.c):
            return got
        got = measure_costs(model, drafter, max(ws), context=at or COST_CONTEXT, budget_s=float("inf"),
                            min_rounds=self.rounds, max_rounds=self.rounds, widths=ws,
                            target=ShardedTarget(model, self.split))
        got = share_costs(got, self.split.group)
        self.held[key] = got
        return got

    def remember(self, model, drafter, costs: Costs) -> None:
        self.held[(id(model), id(drafter), None)] = costs


def share_costs(c: Costs, group) -> Costs:
    """Rank 0's cost curve on every rank."""
    ws = sorted(c.c)
    dws = sorted(c.d)
    v = broadcast_floats([c.t1, c.t_plain, c.u] + [c.c[w] for w in ws] + [c.d[w] for w in dws], group)
    return Costs(v[0], dict(zip(ws, v[3:3 + len(ws)])), dict(zip(dws, v[3 + len(ws):])), c.context,
                 c.measured_at, v[1], v[2])


class Session:
    """One rank's view of a split target: `stream(prompt, config)` runs the
    decode session on this rank (every rank must call it with the same prompt
    and config, in the same order; `Channel` carries them from rank 0)."""

    def __init__(self, model, tokenizer, drafter, split: Split, measure: bool = True):
        self.model, self.tokenizer, self.drafter, self.split = model, tokenizer, drafter, split
        self.calibration = DistributedCalibration(split)
        t = ShardedTarget(model, split)
        self.comm = measure_comm(split, t.hidden_size, t.dtype) if measure else CommCost(
            {}, forward_ops(split), 1 if split.mode == PIPELINE else 0)
        self.channel = Channel(split.group)

    @property
    def leader(self) -> bool:
        return self.split.rank == 0

    def stream(self, prompt, config: Optional[DecodeConfig] = None,
               prompt_cache: Optional[PromptCache] = None) -> Iterator[GenerationResponse]:
        d = DistributedDecoder(self.model, self.tokenizer, self.drafter, config, prompt_cache, self.calibration,
                               split=self.split, comm=self.comm)
        return d.run(prompt)

    def generate(self, prompt, config: Optional[DecodeConfig] = None, prompt_cache=None) -> tuple:
        """Run to the end: (token ids without a final EOS, from_draft flags, last response)."""
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()
        ids, src, r = [], [], None
        for r in self.stream(prompt, config, prompt_cache):
            if not (r.finish_reason == "stop" and r.token in eos):
                ids.append(r.token)
                src.append(r.from_draft)
        return ids, src, r


# -- serving: rank 0 takes requests, the others run each one with it ------------------------
# DecodeConfig fields that are functions (or per-process), not sent to the other ranks
LOCAL_FIELDS = ("logits_processors", "prefill_progress")


def config_message(cfg: DecodeConfig) -> dict:
    if cfg.logits_processors:
        raise DistributedError("logits processors (logit_bias, penalties, structured output) run on one rank "
                               "only; a split target cannot take them")
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in LOCAL_FIELDS}


class Leader:
    """Rank 0's side of a split target taking requests (a server): each
    request's prompt ids and decode settings go to the other ranks first (two
    all_sums), then every rank runs it. Every rank runs a request to its end,
    so rank 0 does too when its reader stops early (a client that left)."""

    def __init__(self, session: Session):
        if not session.leader:
            raise DistributedError("only rank 0 leads; the other ranks call follow()")
        self.session = session
        self.lock = threading.Lock()  # one request at a time across the ranks

    def stream(self, ids: List[int], config: DecodeConfig) -> Iterator[GenerationResponse]:
        msg = {"ids": [int(i) for i in ids], "config": config_message(config)}
        with self.lock:
            self.session.channel.share(msg)
            gen = self.session.stream(ids, config)
            try:
                for r in gen:  # (not `yield from`: closing this generator would close `gen` too)
                    yield r
            finally:
                for _ in gen:  # a reader that stopped early: the other ranks are running it to the end
                    pass

    def close(self) -> None:
        """Release the other ranks (their follow() returns)."""
        with self.lock:
            self.session.channel.share(None)


def follow(session: Session) -> int:
    """The other ranks' loop: run each request rank 0 shares, until it closes.
    Returns the number of requests run."""
    n = 0
    while True:
        msg = session.channel.share()
        if msg is None:
            return n
        try:
            for _ in session.stream(msg["ids"], DecodeConfig(**msg["config"])):
                pass
        except RuntimeError as e:
            if lost_rank(e) is not None:
                raise
        except (ValueError, TypeError):  # a request rank 0 refused the same way (its caller answers it)
            pass
        n += 1
