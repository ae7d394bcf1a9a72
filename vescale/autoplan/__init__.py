"""The auto-planner. ``scale``: the C++ planner's search over simulated worlds of any size
(cost model, pipeline timeline, memory), validated against published runs."""

from .scale import (LLAMA3_70B_RECIPES, SELENE_RUNS, Candidate, PublishedRun, ScalePlan, Workload,
                    fit_gemm_efficiency, matches_recipe, parse_bytes, plan_at_scale, simulate_step, validate_selene)

__all__ = ["Workload", "PublishedRun", "SELENE_RUNS", "LLAMA3_70B_RECIPES", "Candidate", "ScalePlan", "plan_at_scale",
           "simulate_step", "validate_selene", "fit_gemm_efficiency", "matches_recipe", "parse_bytes"]
