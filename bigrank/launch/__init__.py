"""Ray glue, called by the run layer (``bigrank.run``) and the commands: Ray Train launching (``ray_train``) and
Ray Jobs submission (``jobs``). Both are leaves: they import nothing of the trainer or the commands (``ray_train``
only the worker bootstrap); Ray's start-up is ``bigrank.ray_runtime``, below every package that uses it.

Ray is imported inside the functions (a heavy optional dependency), so importing this package stays cheap.
"""

from __future__ import annotations

from bigrank.launch.ray_train import train_on_ray

__all__ = ["train_on_ray"]
