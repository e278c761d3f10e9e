#!/bin/bash
# side by side: old main (5a5005f, checked out at /work/main) and ours (/work/wt/server), alternating;
# OUT: where results go (OUT/old_N, OUT/new_N); RUNS: the run numbers; the threads env variables pass through
set -u
for i in ${RUNS:-1 2}; do
  for who in old new; do
    if [ $who = old ]; then dir=/work/main; pp=""; else dir=/work/wt/server; pp=/work/wt/server; fi
    echo "== run $i $who $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $dir && MLX_DFLASH_HOME=${OUT:-/tmp/one_engine}/home_$who PYTHONPATH=$pp /work/main/.venv/bin/python -m app.cli bench --quick --out ${OUT:-/tmp/one_engine}/${who}_$i 2>&1 | tail -25)
  done
done
