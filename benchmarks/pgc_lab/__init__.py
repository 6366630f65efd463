"""The lab: the code that produces the project's own results, run from the checkout and not installed.

- :mod:`pgc_lab.experiments`: real-rank experiment jobs, their callbacks, results files and statistics;
- :mod:`pgc_lab.map`: the emulated crossover map's rounds, confirmation, records and audit;
- :mod:`pgc_lab.corrections`: the staleness corrections' stability boundaries and convergence rates;
- :mod:`pgc_lab.demo` and :mod:`pgc_lab.demo_cells`: the race that ``make demo`` runs;
- :mod:`pgc_lab.auto_scenarios`: synthetic per-rank times for ``pgc_auto``'s rule (``benchmarks/auto_detect.py``);
- :mod:`pgc_lab.numbers`: where each number of the docs stands and what it is read from (docs/results/numbers.csv).

The scripts in ``benchmarks/`` find this package beside them; the tests put ``benchmarks/`` on the path.
"""
