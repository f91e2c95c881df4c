"""Data layer: MovieLens ingest, synthetic data and fractal expansion, Parquet layout and streaming."""
