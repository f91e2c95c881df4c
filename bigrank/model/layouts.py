"""The tables whose layout ``model.layout`` sets and the layouts each can take, owned by the model: the cost model
(``bigrank.model.layout``) chooses among them and the config (``bigrank.config``) checks ``model.layout`` against
them. A module of its own because it imports no torch, which the config must not import."""

__all__ = ["LAYOUTS", "LAYOUT_TABLES"]

LAYOUT_TABLES = ("catalog", "user_table", "history_table")
LAYOUTS = ("replicated", "sharded")
