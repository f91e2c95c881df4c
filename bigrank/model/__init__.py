"""Model: the torchrec user tower (row-wise sharded user table, optional history bag) and its sharding.

Heavy imports (torchrec, fbgemm) happen when the submodules are imported, not here:
``from bigrank.model.towers import UserTower`` and ``from bigrank.model.sharding import shard_row_wise``.
"""
