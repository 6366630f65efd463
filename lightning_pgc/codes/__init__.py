"""Pure math of the straggler-tolerance schemes (no Lightning, no torch.distributed).

``make_scheme(name, n, s, **options)`` builds a ``Scheme`` (placement, rotation,
encoder, decoder); ``StaleCache`` is a rank's pipeline state; ``tandon_b``
builds the cyclic gradient code of Tandon et al. (2017); ``BoundedScheme`` and
``CoverageTable`` are the bounded-staleness variant. See ``docs/math.md``.
"""

from __future__ import annotations

from .bounded import CHOICES, BoundedScheme, CoverageTable, Entry, adapt_step, choose_partition, error_decomposition
from .cache import StaleCache
from .placements import CRPlacement, FRPlacement, OwnPlacement, Placement
from .schemes import (
    OPTIONS,
    SCHEMES,
    AutoScheme,
    WARMUPS,
    DGDScheme,
    GCCRScheme,
    GCFRScheme,
    IgnoreScheme,
    PGCCRNaiveScheme,
    PGCCRScheme,
    PGCFRScheme,
    Scheme,
    make_scheme,
)
from .tandon import best_tandon_b, solve_decoding_vector, tandon_b, worst_condition

__all__ = [
    "SCHEMES",
    "WARMUPS",
    "OPTIONS",
    "Scheme",
    "make_scheme",
    "StaleCache",
    "BoundedScheme",
    "CoverageTable",
    "Entry",
    "adapt_step",
    "choose_partition",
    "CHOICES",
    "error_decomposition",
    "tandon_b",
    "best_tandon_b",
    "worst_condition",
    "solve_decoding_vector",
    "Placement",
    "OwnPlacement",
    "FRPlacement",
    "CRPlacement",
    "DGDScheme",
    "IgnoreScheme",
    "AutoScheme",
    "GCFRScheme",
    "GCCRScheme",
    "PGCFRScheme",
    "PGCCRScheme",
    "PGCCRNaiveScheme",
]
