#!/bin/bash
cd /tmp/ft_snap
for f in tests/test_*.py; do
  m=$(basename $f .py)
  start=$(date +%s)
  PYTHONPATH=/tmp/ft_snap timeout 2400 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 $f > /tmp/ft_dur/$m.txt 2>&1
  rc=$?
  echo "$m rc=$rc wall=$(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg)" >> /tmp/ft_dur/summary.txt
done
echo DONE >> /tmp/ft_dur/summary.txt
