"""Training: the Trainer and its parts, checkpoints, the local launcher, the step loss, evaluation.

* ``workers.train_worker(config, manifest=None) -> summary`` — runs ``trainer.Trainer(config, manifest).train()``
  (one loop for every model kind) inside every worker process of an initialised ``torch.distributed`` group
  (local launcher or Ray Train); resumes from the run's newest checkpoint on any worker count. ``manifest``: the
  dataset's ``DatasetManifest`` when the caller read it (the run layer's pre-flight), else the worker reads it once.
  ``workers.evaluate_worker`` / ``export_worker`` load a checkpoint on any worker count.
* ``trainer`` — the loop; ``kind`` — what a model kind supplies to it, to evaluation and to export (each kind
  registered in ``bigrank.model.registry``; ``towers`` and ``model``: the default kind's step, and its tower +
  catalog shard of a rank; each other kind's module beside them); ``state`` — stateful parts; ``checkpoint`` — the
  Checkpointer (DCP, atomic); ``evaluator`` — when to evaluate, each split's data read once.
* ``launcher.launch_local(fn, world_size, args)`` — N local processes on torch elastic (``elastic_launch``),
  failures reported with the rank's traceback; ``bootstrap`` — what every worker process and job sets up first.
* ``losses.StepLoss`` — the configured loss (full-catalog or candidate losses, samplers, warm-up).
* ``plot`` — loss and metrics over epochs (``bigrank plot``). The commands that drive this package live in
  ``bigrank.cli`` (``bigrank train | evaluate | export``: ``bigrank.cli.train``).

Submodules import torch and torchrec; this package itself imports nothing heavy.
"""
