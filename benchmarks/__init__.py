"""cp_softcap's benchmarks: `python -m benchmarks SUITE [--quick] [--dry-run] [--out DIR]`
(benchmarks/__main__.py) runs them; benchmarks/_util.py is their shared harness."""
