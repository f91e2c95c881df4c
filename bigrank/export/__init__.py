"""Embeddings export for serving: Parquet parts + manifest, FAISS item indexes, recommend and serve.

* ``writer.export_embeddings`` — collective export: every rank writes its own rows; rank 0 writes the
  checksummed manifest last.
* ``index`` — exact / IVF / HNSW inner-product indexes, recall against exact.
* ``recommend.load_export`` / ``recommend.Recommender`` — verified loading and top-k recommendation.
* ``ids`` — original ids (int64 or string) of an export: parsing, and the index that maps them to dense ids.
* ``serve`` — a small HTTP JSON endpoint; ``ray_serve`` — the same on Ray Serve; ``reload`` — a new export served.
  The commands live in ``bigrank.cli.export`` (``bigrank recommend | serve | build-index``).

Heavy libraries (pyarrow, faiss, torch) are imported where they are used.
"""
