"""The auto-planner. ``eager``: ``vescale.generate_plan``, plans for the ranks at hand from
the model's eager execution (profile, what-if runs over virtual meshes, measured
collectives, the C++ search). ``scale``: the C++ planner's search over simulated worlds
of any size (cost model, pipeline timeline, memory), validated against published runs."""

from .commfit import CommModel, measure_comm
from .eager import CONSTRAINTS, EagerCandidate, EagerPlan, generate_plan, plan_eager
from .profile import Profile, profile_model
from .scale import (LLAMA3_70B_RECIPES, NEMO_H100_FP8_RUNS, SELENE_RUNS, Candidate, PublishedRun, ScalePlan,
                    Workload, fit_fp8_gemm_efficiency, fit_gemm_efficiency, matches_recipe, parse_bytes,
                    plan_at_scale, simulate_step, validate_nemo_fp8, validate_runs, validate_selene)
from .tp_search import tensor_parallel_plan
from .virtual import VirtualMesh

__all__ = ["Workload", "PublishedRun", "SELENE_RUNS", "NEMO_H100_FP8_RUNS", "LLAMA3_70B_RECIPES", "Candidate",
           "ScalePlan", "plan_at_scale", "simulate_step", "validate_runs", "validate_selene", "validate_nemo_fp8",
           "fit_gemm_efficiency", "fit_fp8_gemm_efficiency", "matches_recipe", "parse_bytes",
           "generate_plan", "plan_eager", "EagerPlan", "EagerCandidate", "CONSTRAINTS", "CommModel", "measure_comm",
           "Profile", "profile_model", "VirtualMesh", "tensor_parallel_plan"]
