"""The benchmarks, as one suite: `python -m benchmarks --list`, `python -m benchmarks SECTION ...`
(benchmarks/__main__.py). Each bench module stays runnable as a script of its own."""
