"""The former import path of :mod:`lightning_pgc.callbacks.stragglers` (the delay models and the straggler
injector), kept so that code importing ``lightning_pgc.stragglers`` keeps working. New code imports
:mod:`lightning_pgc.callbacks.stragglers`."""

from lightning_pgc.callbacks.stragglers import *  # noqa: F401,F403
from lightning_pgc.callbacks.stragglers import __all__  # noqa: F401
