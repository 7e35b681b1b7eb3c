"""The benchmark scenarios, one module each, run from the checkout's root by one runner:

    python -m scripts.bench                      # every scenario, a line each
    python -m scripts.bench SCENARIO --help      # its options
    python -m scripts.bench SCENARIO [options]   # run it; most append a table to BENCHMARKS.md

A scenario is a module here (or a `.sh` file, run with bash) whose docstring's first line says
what it measures and whose `main(argv)` takes its options; modules starting with `_` are helpers.
They import `batcher` as installed (the checkout's own, `pip install -e`), `scripts.bench._shared`
and the test helpers under `tests/` as packages of the checkout: nothing edits `sys.path`. A
scenario that runs another checkout's code (`--base DIR`, `--against REV`, `--checkout`) starts
that code in a process of its own, from that checkout's folder.

`batcher bench` (the installed load generator, `batcher/bench/`) is what several of them drive.
"""
