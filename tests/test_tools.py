"""The developer tools around the package: the embedded-model pipeline is one
entry point (`python -m tools.embedded COMMAND`), scripts/ keeps only the
bootstrap-type files, and no script, tool or archived benchmark edits sys.path."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.embedded import __main__ as embedded

ROOT = Path(__file__).resolve().parent.parent


def test_every_command_is_a_module_with_main_or_a_recipe():
    for name, (target, help) in embedded.COMMANDS.items():
        assert help and name.replace("-", "").isalpha()
        if target.endswith(".sh"):
            text = (ROOT / "tools" / "embedded" / target).read_text()
            assert text.startswith("#!/usr/bin/env bash") and 'cd "$(dirname "$0")/../.."' in text
            assert "scripts/" not in text.replace("tools/embedded/", ""), target  # every step through the tool
        else:
            assert (ROOT / "tools" / "embedded" / f"{target}.py").exists(), name


@pytest.mark.parametrize("name", sorted(embedded.COMMANDS))
def test_help_of_every_command(name, capsys):
    try:
        rc = embedded.main([name, "--help"])
    except SystemExit as e:  # argparse's own --help
        rc = e.code
    out = capsys.readouterr().out
    assert rc == 0 and out.strip()
    if not embedded.COMMANDS[name][0].endswith(".sh"):
        assert out.startswith(f"usage: python -m tools.embedded {name}")


def test_usage_and_unknown_command(capsys):
    assert embedded.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m tools.embedded COMMAND") and all(n in out for n in embedded.COMMANDS)
    assert embedded.main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'nope'" in err[0]


def test_merge_responses_shifts_indices_and_skips_a_cut_line(tmp_path, capsys):
    (tmp_path / "prompts_gsm.jsonl").write_text('{"messages": 1}\n{"messages": 2}\n')
    (tmp_path / "responses_gsm.jsonl").write_text('{"i": 1, "ids": [5]}\n{"i": 0, "ids": [4]}\n')
    (tmp_path / "prompts_code.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    (tmp_path / "responses_code.jsonl").write_text('{"i": 2, "ids": [7]}\n{"i": 0, "id')  # the time box cut it
    assert embedded.main(["merge-responses", str(tmp_path), "gsm", "code"]) == 0
    prompts = (tmp_path / "prompts.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert prompts == ['{"messages": 1}', '{"messages": 2}', '{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "c"}']
    assert rows == [{"i": 0, "ids": [4]}, {"i": 1, "ids": [5]}, {"i": 4, "ids": [7]}]
    assert "code: 1 of 3 prompts answered" in capsys.readouterr().out


def test_entry_point_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "tools.embedded", "merge-responses"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "usage: python -m tools.embedded merge-responses" in r.stderr


def test_scripts_keep_only_bootstrap_tools():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == ["bootstrap.sh", "gpu_check.sh", "import_graph.py"]


def test_no_script_tool_or_benchmark_edits_sys_path():
    edits = re.compile(r"sys\.path\.(insert|append)|sys\.path\s*\+?=")
    found = [str(p.relative_to(ROOT)) for d in ("scripts", "tools", "bench", "app", "mlx_dflash")
             for p in (ROOT / d).rglob("*.py") if edits.search(p.read_text())]
    assert found == []
