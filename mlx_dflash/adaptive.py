"""Compatibility names: the adaptive width policy is `policy.AdaptiveWidth`, its
cost curve `calibrate.Costs` / `calibrate.measure_costs`. Import from those."""

from .calibrate import Costs, cost_key, cost_path, get_costs, load_cached, measure_costs, remember, save_cached  # noqa: F401
from .policy import AdaptiveWidth  # noqa: F401
