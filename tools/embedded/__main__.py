"""`python -m tools.embedded COMMAND [ARGS]`: the embedded-model pipeline.

Each command is a module of this folder with `main(argv)`, or a staged shell
recipe (STAGE=... UNTIL=... and the other variables at its top pass through);
only the chosen one is imported. `python -m tools.embedded COMMAND --help`
says more."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (module or shell recipe in this folder, one line)
COMMANDS = {
    "target": ("target", "the target and the draft-ar model: prepare, prepare-tools, prepare-choice, bench, train, "
                         "export, interpolate, evaluate, card"),
    "drafter-data": ("drafter_data", "prompt and corpus files for training the drafters"),
    "merge-responses": ("merge_responses", "one prompt file and one response cache from per-set ones"),
    "tau": ("tau", "greedy tau of DFlash 1 vs DFlash 2 drafters and tok/s against plain decoding"),
    "drafter-card": ("drafter_card", "a drafter's model card from its training run and the tau bench"),
    "check-agent": ("check_agent", "can an agent talk to the embedded target (against a real serve)"),
    "tool-choice": ("eval_tool_choice", "does a model call the tools a request offers (held-out names)"),
    "train-drafters": ("train_drafters.sh", "the drafters' whole run: data, gen, train, export, bench"),
    "refresh-drafter": ("refresh_drafter.sh", "fine-tune the DFlash 2 drafter on a changed target's responses"),
    "unlearn-loops": ("unlearn_loops.sh", "the target's phase 4: unlikelihood on its own greedy loops"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help}" for name, (_, help) in COMMANDS.items()]
    return ("usage: python -m tools.embedded COMMAND [ARGS]\n\nThe embedded-model pipeline (tools/embedded/).\n\n"
            "commands:\n" + "\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"python -m tools.embedded: unknown command '{name}'; one of: {', '.join(COMMANDS)}\n")
        return 2
    target = COMMANDS[name][0]
    if target.endswith(".sh"):
        if rest and rest[0] in ("-h", "--help"):  # the recipe's header says what it does and takes
            head = (HERE / target).read_text().split("\nset -euo pipefail", 1)[0]
            print("\n".join(line[2:] for line in head.splitlines()[1:]))
            return 0
        return subprocess.run(["bash", str(HERE / target), *rest], env=os.environ, check=False).returncode
    sys.argv = [f"python -m tools.embedded {name}", *rest]  # what argparse prints as the program
    return importlib.import_module(f"{__package__}.{target}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
