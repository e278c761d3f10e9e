"""One prompt file and one on-policy response cache from per-set ones (the
drafter scripts' generation stage: train_drafters.sh, refresh_drafter.sh).

    python -m tools.embedded merge-responses DATA_DIR SET [SET ...]

Reads DATA_DIR/prompts_SET.jsonl and DATA_DIR/responses_SET.jsonl (a set's
cache may be missing or end in a line cut short by its time box), writes
DATA_DIR/prompts.jsonl (the sets in order) and DATA_DIR/responses.jsonl (each
response's prompt index shifted to its place there)."""

import argparse
import json
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("sets", nargs="+", metavar="SET")
    a = ap.parse_args(argv)
    d, sets = a.data_dir, a.sets
    n = 0
    with open(d / "prompts.jsonl", "w") as p, open(d / "responses.jsonl", "w") as r:
        for s in sets:
            lines = (d / f"prompts_{s}.jsonl").read_text().splitlines()
            p.write("".join(line + "\n" for line in lines))
            rows = []
            f = d / f"responses_{s}.jsonl"
            for line in (f.read_text().splitlines() if f.exists() else []):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by the time box
                    pass
            for row in sorted(rows, key=lambda row: row["i"]):
                row["i"] += n
                r.write(json.dumps(row) + "\n")
            print(f"{s}: {len(rows)} of {len(lines)} prompts answered")
            n += len(lines)
    print(f"{n} prompts with responses in {d / 'responses.jsonl'}")

