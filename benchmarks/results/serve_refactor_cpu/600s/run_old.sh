cd /work/old && source .venv/bin/activate && export TORCHINDUCTOR_CACHE_DIR=/tmp/bench41/ic_old TRITON_CACHE_DIR=/tmp/bench41/tc_old
taskset -c 0 kivi bench serve --budget-gib 0.2 --max-seq-len 2048 --length-scale 0.25 --residual-length 32 --duration 600 --requests 3000 --compile --threads 1 --caches kivi,kivi-paged --out /tmp/bench41/old --json > /tmp/bench41/old.json 2> /tmp/bench41/old.err
echo "rc=$?" >> /tmp/bench41/old.err
