"""End-to-end evaluation against every baseline (see percache_core/bench_e2e.py).

    .venv/bin/python benchmarks/e2e.py --data ../shared/data --quick --taus 0.6,0.75,0.85,0.95
    .venv/bin/python benchmarks/e2e.py --data my/data --qmsum-users 5 --squad-users 2 --queries-per-user 12

Same options as `percache bench e2e`; writes JSON, a Markdown table and PNG plots.
"""

import sys

from percache_core.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "e2e", *sys.argv[1:]]))
