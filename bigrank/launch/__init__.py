"""Ray glue: Ray Train launching (``ray_train``) and Ray Jobs submission (``jobs``).

Ray is imported lazily inside the functions, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train_on_ray", "train_with_ray"]


def train_on_ray(config, *, address: str | None = None) -> dict[str, Any]:
    """Train ``config`` on Ray Train (see :func:`bigrank.launch.ray_train.train_on_ray`)."""
    from bigrank.launch.ray_train import train_on_ray as run

    return run(config, address=address)


# bigrank.train.commands (`bigrank train --launcher ray`) calls this name.
train_with_ray = train_on_ray
