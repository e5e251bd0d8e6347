cd /work/main && source .venv/bin/activate && export TORCHINDUCTOR_CACHE_DIR=/tmp/bench41/ic_new TRITON_CACHE_DIR=/tmp/bench41/tc_new
taskset -c 1 python -c "
import sys
import kivi_ops.compile_budget as cb
cb.install_avx2_byte_loads = lambda: False  # ATen's byte loads, as 9c2489d has: the serving code alone differs
from kivi_cli.main import main
sys.argv = ['kivi'] + sys.argv[1:]
sys.exit(main(sys.argv[1:]))
" bench serve --budget-gib 0.2 --max-seq-len 2048 --length-scale 0.25 --residual-length 32 --duration 600 --requests 3000 --compile --threads 1 --caches kivi,kivi-paged --out /tmp/bench41/new --json > /tmp/bench41/new.json 2> /tmp/bench41/new.err
echo "rc=$?" >> /tmp/bench41/new.err
