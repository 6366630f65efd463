"""PGCStrategy and its parts: the Lightning glue of pipelined gradient coding, one concept per module.

``strategy`` holds the hooks Lightning calls; the parts it delegates to are ``options`` (the constructor's option
groups and their checks), ``preflight`` (the setups refused before any rank starts), ``loaders`` (the training
DataLoader re-created as under ``ddp``, around the partition sampler of :mod:`lightning_pgc.sampling`),
``leadership`` (who does Lightning's rank-zero work), ``live_routing`` (collectives among the live ranks),
``rejoin`` (state transfer after falling behind), ``pipeline_checkpoint`` (each rank's stale cache next to
Lightning's checkpoint), ``arms`` (the arms of ``scheme="auto"``), ``gradients`` (the payload layout) and
``bounded_choice`` (the partition choice of the bounded scheme). Each part states what it uses of the strategy as
a ``Protocol`` of its own, so none imports ``strategy``.
"""

from lightning_pgc.strategy.strategy import REGISTERED, PGCStrategy, Registered, StepInfo

__all__ = ["PGCStrategy", "REGISTERED", "Registered", "StepInfo"]
