"""Offload under a GPU memory budget: decoder layers' weights streamed from host memory
(:func:`offload_weights_`), and the plan / cost model that says what that costs (:func:`plan_offload`); MoE
models' routed experts kept and computed on the host (:func:`offload_experts_`)."""

from .host_experts import HostExperts, offload_experts_
from .plan import OffloadCost, OffloadPlan, plan_offload, simulate_step
from .streaming import OffloadedLayer, WeightStreamer, offload_weights_

__all__ = ["HostExperts", "OffloadCost", "OffloadPlan", "OffloadedLayer", "WeightStreamer", "offload_experts_",
           "offload_weights_", "plan_offload", "simulate_step"]
