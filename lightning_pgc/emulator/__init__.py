"""The emulator: the real leaders and schemes on the simulated clock, with real training (research code).

Not imported by ``import lightning_pgc``. :func:`~lightning_pgc.emulator.train.emulate` trains a model on a
schedule of admitted sets and ages (from the simulated clock or a recorded real run), computing every aggregate
exactly; see ``docs/results/emulator.md``.
"""
