"""Embeddings export for serving: Parquet parts + manifest, FAISS item indexes, recommend and serve.

* ``writer.export_embeddings`` — collective export: every rank writes its own rows; rank 0 writes the
  checksummed manifest last.
* ``index`` — exact / IVF / HNSW inner-product indexes, recall against exact.
* ``recommend.load_export`` / ``recommend.Recommender`` — verified loading and top-k recommendation.
* ``serve`` — a small HTTP JSON endpoint; ``commands`` — ``bigrank recommend | serve | build-index``.

Heavy libraries (pyarrow, faiss, torch) are imported where they are used.
"""
