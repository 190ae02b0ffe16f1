"""The replica check's digests and its messages, named here beside the rest of reliability: they
live with the engines that raise :class:`ReplicaMismatch` (:mod:`pipesgd.engine.replicas`)."""

from ..engine.replicas import (EXACT_GROUPS, MOMENTS, ReplicaMismatch, describe_mismatch, describe_summed_mismatch,
                               digest, moments)

__all__ = ["EXACT_GROUPS", "MOMENTS", "ReplicaMismatch", "describe_mismatch", "describe_summed_mismatch", "digest",
           "moments"]
