"""`CheckpointManager` (`manager`; its restore in `manager_restore`) and what it drives in a training loop: a tier as
the manager drives it (`managed_tier`) over a root's step bookkeeping (`tier`, `steps`: what a step directory is,
`root_lock`: one saving manager per root), the local tier's own rules (`local_tier`), staging one step for the tiers
it is due for (`step_save`), save and preservation policies (`policies`), SIGTERM (`preemption`), which step a
restart resumes from (`resume`), modules, optimizers and schedulers <-> state trees and RNG states
(`training_state`, `rng_state`), peer copies of local steps (`peer_copies/`, a folder: one module per idea), and
resuming another tool's run (`foreign_runs`).
"""
