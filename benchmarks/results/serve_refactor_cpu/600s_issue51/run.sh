#!/bin/bash
# issue 51's check: kivi bench serve, 600 s, old (f77142d) and new side by side, one core each.
ARGS="bench serve --budget-gib 0.2 --max-seq-len 2048 --length-scale 0.25 --residual-length 32 --duration 600 --requests 3000 --compile --threads 1 --caches kivi-paged --json"
(cd /work/main && export TORCHINDUCTOR_CACHE_DIR=/tmp/bench51/ic_new TRITON_CACHE_DIR=/tmp/bench51/tc_new &&
 taskset -c 1 .venv/bin/kivi $ARGS --out /tmp/bench51/new > /tmp/bench51/new.json 2> /tmp/bench51/new.err; echo "rc=$?" >> /tmp/bench51/new.err) &
(cd /work/old && export TORCHINDUCTOR_CACHE_DIR=/tmp/bench51/ic_old TRITON_CACHE_DIR=/tmp/bench51/tc_old &&
 taskset -c 0 .venv/bin/kivi $ARGS --out /tmp/bench51/old > /tmp/bench51/old.json 2> /tmp/bench51/old.err; echo "rc=$?" >> /tmp/bench51/old.err) &
wait
