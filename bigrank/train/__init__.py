"""Training: the distributed trainer loop, checkpoints, the local launcher, losses by config, evaluation.

* ``loop.train_worker(config) -> summary`` — runs inside every worker process of an initialised
  ``torch.distributed`` group (local launcher or Ray Train); resumes from the run's newest checkpoint.
* ``launcher.launch_local(fn, world_size, args)`` — N local gloo processes, failures reported with the rank's
  traceback.
* ``checkpoint`` — atomic per-step checkpoints (DCP user tower + per-rank catalog rows and states).
* ``losses.StepLoss`` — the configured loss (full-catalog or candidate losses, samplers, warm-up).
* ``commands`` — ``bigrank train | evaluate | export``.

Submodules import torch and torchrec; this package itself imports nothing heavy.
"""
