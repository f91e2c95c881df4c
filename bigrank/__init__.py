"""bigrank: ranking losses and a distributed trainer for recommenders with very large item catalogs."""

__version__ = "0.1.0"
