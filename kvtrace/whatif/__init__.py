"""What-if replay: what paging, eviction or KV quantisation would save on a recorded
trace and what it would cost in attention (offline proxies; no rerun of the model).

numpy only: importing this package must work without torch.
"""

from kvtrace.whatif.policies import REGISTRY, Policy, PolicyError, parse_policy

__all__ = ["REGISTRY", "Policy", "PolicyError", "parse_policy"]
