"""The theory lab (research code, not imported by ``import lightning_pgc``): exact computations on a quadratic.

- :mod:`~lightning_pgc.theory.quadratic`: what the convergence proofs assume, tested on one aggregate and on exact
  stochastic simulations of the schemes (coefficients, the error decomposition, the constants, delayed-gradient
  stability);
- ``benchmarks/pgc_lab/corrections.py`` (in the repository): the staleness corrections' stability boundaries and convergence rates.

``docs/results/theory.md`` explains both.
"""
