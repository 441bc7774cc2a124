"""Assembly, above the engine: a run's plan computed once (raysim.assembly.plan), `run` and
`resume` (raysim.assembly.run, with the resume checks of raysim.assembly.resume), and the
server-recovery wrapper (raysim.assembly.recovery). The round loop itself is raysim.core.loop."""

from raysim.assembly.plan import RunPlan, plan_run
from raysim.assembly.run import RunResult, resume, run, start_backend

__all__ = ["RunPlan", "RunResult", "plan_run", "resume", "run", "start_backend"]
