"""tvmpipe.partition: split a graph into pipeline stages and predict how the pipeline will run.

See docs/partition.md. The plan API (Plan, plan_equal_ops, validate_plan) needs only the graph;
planning by cost goes through a PipelineModel (graph + op costs + devices + link).
"""

from tvmpipe.partition.errors import PartitionError, PlanError
from tvmpipe.partition.model import PipelineModel
from tvmpipe.partition.plan import Plan, checked_plan, plan_equal_ops, validate_plan
from tvmpipe.partition.planners import make_plan, plan_optimal
from tvmpipe.partition.predict import Prediction, predict
from tvmpipe.partition.sweep import Measured, SweepCase, sweep_plans

__all__ = ["PartitionError", "PlanError", "PipelineModel", "Plan", "checked_plan", "plan_equal_ops", "validate_plan",
           "make_plan", "plan_optimal", "Prediction", "predict", "Measured", "SweepCase", "sweep_plans"]
