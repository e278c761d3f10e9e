"""DFlash on a target split over two ranks (mx.distributed, ring backend on
127.0.0.1, CPU): tests/dist_ranks.py runs on each rank; a tensor-parallel family
(qwen3) and a pipeline family (qwen2), tiny random weights from mlx-lm's ModelArgs.

- greedy, widths 1/5/8 and the guard: the token ids equal plain decoding and the
  single-process DFlash run (same drafts accepted at the same places, the
  drafter's features equal to float rounding: tensor parallelism sums in
  another order, pipeline parallelism is exact);
- sampled, seeded and unseeded: every rank emits the same tokens;
- a rank that dies: the other exits with one line, not a hang."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RANKS = HERE / "dist_ranks.py"
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
LOST_BOUND_S = 60  # a lost rank is reported well within this (the ring backend gives up after its retries)
RUN_LIMIT_S = 800  # below pytest's own timeout, so a hang ends here with the ranks' output
# every test launches ranks (18-120 s each here): none fits the fast tier
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(cmd, env=None):
    """Run `cmd` (mlx.launch and its ranks) in its own process group; on a hang
    the whole group is stopped (the ranks too, not only the launcher)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the ranks did not finish in {RUN_LIMIT_S} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _ports(n=2) -> int:
    """A base port with n free ports after it (the ring backend listens on base..base+n-1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for k in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + k))
                socks.append(t)
            for t in socks:
                t.close()
            return base
        except OSError:
            for t in socks:
                t.close()
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def lossless(tmp_path_factory):
    if LAUNCH is None:
        pytest.skip("mlx.launch is not installed")
    out = tmp_path_factory.mktemp("dist")
    cmd = [LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(_ports()), "--python", sys.executable,
           str(RANKS), str(out), "lossless"]
    r = launch(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]


def test_greedy_equals_single_process(lossless):
    r0, r1 = lossless
    widths = [k for k in r0 if "/w" in k]
    assert len(widths) == 6  # two families x widths 1, 5, 8
    for k in widths:
        a, b = r0[k], r1[k]
        assert a["split"] == a["plain"] == a["single"], k  # lossless, and what one process emits
        assert b["split"] == a["split"] and b["split_src"] == a["split_src"], k
        assert a["split_src"] == a["single_src"], k  # the same drafts accepted at the same places
        assert [x[1] for x in a["split_log"]] == [x[1] for x in a["single_log"]], k  # the drafter's own drafts
        for (f1, _), (f2, _) in zip(a["single_log"], a["split_log"]):  # the features it received
            assert (f1 is None) == (f2 is None) and (f1 is None or abs(f1 - f2) <= 1e-4 * (1 + abs(f1))), k
        if k.endswith("/w1"):
            assert not any(a["split_src"]), k
        else:
            assert any(a["split_src"]), k  # drafts were accepted: rollback ran at several depths
        info = a["info"]
        assert info["ranks"] == 2 and info["collectives"] > 0 and info["t_collectives"] > 0, k


def test_pipeline_layers_split(lossless):
    r0, r1 = lossless
    k = "qwen2/pipeline/p0/w5"
    assert r0[k]["info"]["split"] == "pipeline"
    assert r0[k]["info"]["layers"] != r1[k]["info"]["layers"]  # each rank holds its own stage
    assert r0["qwen3/tensor/p0/w5"]["info"]["layers"] == r1["qwen3/tensor/p0/w5"]["info"]["layers"]


def test_guard_same_on_every_rank(lossless):
    r0, r1 = lossless
    keys = [k for k in r0 if k.endswith("/guard")]
    assert len(keys) == 4
    for k in keys:
        assert r0[k]["split"] == r0[k]["plain"] == r1[k]["split"], k
        assert r0[k]["split_src"] == r1[k]["split_src"], k


def test_sampled_same_on_every_rank(lossless):
    r0, r1 = lossless
    for k in ("qwen3/tensor/sampled", "qwen2/pipeline/sampled"):
        assert r0[k]["split"] == r1[k]["split"] and r0[k]["split_src"] == r1[k]["split_src"], k
        assert r0[k]["unseeded"] == r1[k]["unseeded"], k
        assert [x[1] for x in r0[k]["split_log"]] == [x[1] for x in r1[k]["split_log"]], k
        assert len(r0[k]["split"]) == 20


def test_served_requests_keep_the_ranks_in_step(lossless):
    """Rank 0 leads two requests (its reader leaves the first after 3 tokens), the
    other rank follows both; then both decode in step, still lossless."""
    r0, r1 = lossless
    for k in ("qwen3/tensor/served", "qwen2/pipeline/served"):
        a, b = r0[k], r1[k]
        assert len(a["early"]) == 3 and a["served"] == a["plain"], k
        assert b["followed"] == 2, k
        assert a["after"] == b["after"] == a["plain"], k


def test_lost_rank_is_one_line(tmp_path):
    """Rank 1 is killed mid-generation; rank 0 exits with one line of its own.
    The ranks are started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE),
    without the launcher, which would also stop rank 0 itself."""
    base = _ports()
    host = tmp_path / "hosts.json"
    host.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(host))
        procs.append(subprocess.Popen([sys.executable, str(RANKS), str(tmp_path), "kill"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent))
    try:
        _, err1 = procs[1].communicate(timeout=600)
        assert procs[1].returncode == -9, err1[-2000:]  # it died as planned
        _, err0 = procs[0].communicate(timeout=LOST_BOUND_S)  # a hang fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 1, err0[-2000:]
    ours = [line for line in err0.splitlines() if line.startswith("mlx-dflash")]
    assert len(ours) == 1 and "rank 0: lost contact with another rank" in ours[0], err0[-2000:]
    assert "Traceback" not in err0


def test_generate_command_under_mlx_launch(tmp_path):
    """`mlx-dflash generate --json` on two ranks (the embedded pair, float32):
    rank 0 prints the single-process plain decoding's token ids, with the split's stats."""
    if LAUNCH is None:
        pytest.skip("mlx.launch is not installed")
    args = ["-m", "app.cli", "generate", "--prompt", "Write a haiku about the sea", "--max-tokens", "16",
            "--dtype", "float32", "--json"]
    env = dict(os.environ, MLX_DFLASH_HOME=str(tmp_path))
    one = subprocess.run([sys.executable, *args, "--verify-mode", "off"], capture_output=True, text=True,
                         timeout=600, cwd=HERE.parent, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = launch([LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(_ports()), "--python",
                  sys.executable, *args], env)
    assert two.returncode == 0, two.stderr[-2000:]
    lines = [json.loads(x) for x in two.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    ref = json.loads(one.stdout.strip().splitlines()[-1])
    assert lines[0]["token_ids"] == ref["token_ids"]
    d = lines[0]["stats"]["distributed"]
    assert d["ranks"] == 2 and d["split"] == "tensor" and d["collectives"] > 0


def test_more_cache_kinds_split(tmp_path):
    """Rollback of every cache kind on every rank: recurrent state (qwen3_next),
    wrapping sliding windows (ministral3), both split by pipeline, and sliding
    windows + MoE split tensor-parallel (gpt_oss); widths 5 and 8, greedy."""
    if LAUNCH is None:
        pytest.skip("mlx.launch is not installed")
    r = launch([LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(_ports()), "--python", sys.executable,
                str(RANKS), str(tmp_path), "families"])
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert len(r0) == 6
    for k, a in r0.items():
        assert a["split"] == a["plain"] == r1[k]["split"], k
        assert a["split_src"] == r1[k]["split_src"] and any(a["split_src"]), k
