"""Data layer: ingest of any interaction log (``ingest``: Parquet, CSV/TSV, JSON Lines on DuckDB or on a Ray
cluster; MovieLens is one preset), synthetic data and fractal expansion, the Parquet layout and its manifest,
streaming, samplers and the per-user index. The commands live in ``bigrank.cli.data``."""
